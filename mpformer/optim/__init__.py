from mpformer.optim.builder import build_optimizer
from mpformer.optim.clip import clip_grad_norm
from mpformer.optim.lr import LRSchedule

__all__ = ["LRSchedule", "build_optimizer", "clip_grad_norm"]
