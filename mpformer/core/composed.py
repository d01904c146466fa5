"""A composed run configuration, and where the Hydra config tree lives.

:class:`Composed` is what :func:`mpformer.cli.compose.compose_config` returns: the typed config, the
resolved YAML that ``resolved_config.yaml`` holds, the run directory and the user's overrides (to
tell what the user pinned from what a preset chose). It lives in the core so that preflight, the
auto-configurator and the trainer can take it without importing the CLI layer.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mpformer.core.config import Config
from mpformer.core.errors import ConfigError

if TYPE_CHECKING:
    from omegaconf import DictConfig


def config_dir() -> Path:
    """$MPFORMER_CONFIG_DIR if set, else configs/ of this checkout (editable install), else the copy a
    regular install puts under sys.prefix/share/mpformer/configs."""
    env = os.environ.get("MPFORMER_CONFIG_DIR")
    candidates = [Path(env)] if env else [Path(__file__).resolve().parents[2] / "configs",
                                          Path(sys.prefix) / "share" / "mpformer" / "configs"]
    for d in candidates:
        if (d / "config.yaml").is_file():
            return d
    raise ConfigError(f"no config.yaml in {', '.join(map(str, candidates))}; set MPFORMER_CONFIG_DIR to mpformer's "
                      "configs/")


@dataclass
class Composed:
    cfg: Config
    raw: DictConfig  # the composed tree, resolved, without the hydra node
    run_dir: str
    overrides: list[str]

    def _keys(self) -> list[str]:
        return [o.split("=", 1)[0].lstrip("+~") for o in self.overrides]

    def overridden_group(self, group: str) -> bool:
        """Whether the user picked a preset for ``group`` (``model=gpt2``)."""
        return group in self._keys()

    def overridden_keys(self, group: str) -> list[str]:
        """Top-level keys of ``group`` the user set (``model.hidden_dropout=0.1`` -> hidden_dropout)."""
        return [k.split(".")[1] for k in self._keys() if k.startswith(group + ".")]
