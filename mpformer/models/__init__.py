"""The decoder-only model family (GPT-2, Llama, Mistral, Qwen2) and how it is cut for tensor and
pipeline parallelism. Its configuration, ModelConfig, is in :mod:`mpformer.core.model_config`."""

from mpformer.models.transformer import Transformer

__all__ = ["Transformer"]
