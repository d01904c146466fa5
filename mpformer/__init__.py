"""mpformer: a Megatron-style model-parallel transformer training framework."""

__version__ = "0.1.0"
