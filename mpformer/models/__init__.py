from typing import Any

from mpformer.models.config import ModelConfig

__all__ = ["ModelConfig", "Transformer"]


def __getattr__(name: str) -> Any:
    # Lazy: layers/ import models.config, and models.transformer imports layers/.
    if name == "Transformer":
        from mpformer.models.transformer import Transformer

        return Transformer
    raise AttributeError(name)
