"""How a model is built, apart from its shape (ModelConfig) and its layout (the parallel contexts).

One frozen value, handed from the run's configuration to ``build_rank``, ``build_model`` and
``Transformer`` unchanged, instead of the same six keywords threaded through each of them: a new
build option is one field here and one read where it acts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from mpformer.core.fp8_config import Fp8Options
from mpformer.core.layer_spec import LINEAR_KINDS
from mpformer.core.layout import RECOMPUTE

if TYPE_CHECKING:
    from mpformer.core.config import TrainConfig
    from mpformer.core.layout import ParallelLayout

# Tokens per chunk of the fused cross entropy (layers/fused_cross_entropy.py; train.cross_entropy_chunk).
DEFAULT_CHUNK = 1024


@dataclass(frozen=True)
class ModelOptions:
    """``recompute`` (none | selective | full) applies to the first ``recompute_layers`` layers of each
    pipeline chunk (None: all of them); ``use_apex``: apex's fused norms where installed;
    ``document_eos``: attention stays inside each document of a packed sequence (documents end with
    this token); ``linear_kind``: the linear layers' kind; ``fused_cross_entropy``: the loss
    ``cross_entropy_chunk`` tokens at a time, never forming the full logits (False: logits, then the
    cross entropy); ``fp8``: the linear layers' float8 settings (train.precision=fp8, models/fp8.py),
    None: no float8."""

    recompute: str = "none"
    recompute_layers: int | None = None
    use_apex: bool = False
    document_eos: int | None = None
    fused_cross_entropy: bool = True
    cross_entropy_chunk: int = DEFAULT_CHUNK
    linear_kind: str = "default"  # the linear layers of every block (core/layer_spec.py LINEAR_KINDS)
    fp8: Fp8Options | None = None

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute={self.recompute!r}; valid: {', '.join(RECOMPUTE)}")
        if self.linear_kind not in LINEAR_KINDS:
            raise ValueError(f"linear_kind={self.linear_kind!r}; valid: {', '.join(sorted(LINEAR_KINDS))}")
        if self.cross_entropy_chunk < 1:
            raise ValueError(f"cross_entropy_chunk={self.cross_entropy_chunk} must be >= 1")

    @classmethod
    def for_run(cls, layout: ParallelLayout, train: TrainConfig, document_eos: int | None) -> ModelOptions:
        """The options a run's configuration gives: recompute from the layout, the rest from ``train``."""
        return cls(recompute=layout.recompute, recompute_layers=layout.recompute_layers, use_apex=train.use_apex,
                   document_eos=document_eos, fused_cross_entropy=train.fused_cross_entropy,
                   cross_entropy_chunk=train.cross_entropy_chunk,
                   fp8=Fp8Options.from_config(train.fp8) if train.precision == "fp8" else None)


# The options of a model built without a run (tests, conversion): frozen, so one value serves every caller.
DEFAULT_OPTIONS = ModelOptions()
