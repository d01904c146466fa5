"""``train.precision=fp8`` and the ``train.fp8`` group: keys, defaults and their rules (issue 35).

Torch-free (core/): the Hydra schema (``Fp8Config``), the frozen value the model is built with
(``Fp8Options``, carried by core/model_options.py's ModelOptions) and the validation that runs before any
process group exists. The numerics live in layers/fp8.py and layers/fp8_linear.py; the model applies
these options in models/fp8.py.

What fp8 means here (torchao's float8 training, Transformer Engine's fp8_autocast): the linear layers'
GEMMs (forward, dX, dW) run in float8 through ``_scaled_mm``; everything else is bf16, as under
``train.precision=bf16`` (bf16 parameters, fp32 master weights and main gradients, bf16 autocast). No
loss scaler: the gradients' own scales (and e5m2 under one scale per tensor) keep the range, so fp8 with
fp16 has no spelling (and ``train.fp8.*`` set under another precision is an error rather than a silent no-op).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mpformer.core.errors import ConfigError, format_choices

FP8_RECIPES = ("tensorwise", "rowwise", "delayed")  # = layers/fp8.py RECIPES
FP8_GRAD_DTYPES = ("auto", "e4m3", "e5m2")  # layers/fp8.py FORMATS, and auto (grad_format below)
# Kept in bf16 by default (as torchao and TE do): the embedding (a lookup, no GEMM), the LM head (the
# logits' range is the loss's, and its GEMM is the vocabulary's: sensitive and often not 16-aligned) and
# the MoE routers (top-k choices flip on a float8 rounding). Canonical module names (models/fp8.py);
# none of them is a float8-able linear today, the list says so and keeps them out when one becomes one.
DEFAULT_KEEP_BF16 = ("embedding.*", "lm_head", "*.router")
COMPUTE_DTYPE = "bf16"  # what fp8 runs outside the float8 GEMMs (parameters, autocast, CPU kernels)


@dataclass
class Fp8Config:
    """``train.fp8.*``: the float8 recipe, the output gradient's format, delayed scaling's amax window and
    headroom, and the layers kept in bf16 (fnmatch patterns on canonical module names, e.g.
    ``layers.0.attn.qkv``, ``layers.*.mlp.down``, ``lm_head``, ``embedding.word``)."""

    recipe: str = "tensorwise"  # tensorwise | rowwise | delayed
    grad_dtype: str = "auto"  # auto | e4m3 | e5m2: dY's format (forward tensors are e4m3); auto: grad_format
    amax_history_len: int = 16  # delayed: the amax window the scale takes its max over
    margin: int = 0  # scale = amax * 2**margin / fmax: powers of two of headroom
    keep_bf16: list[str] = field(default_factory=lambda: list(DEFAULT_KEEP_BF16))


@dataclass(frozen=True)
class Fp8Options:
    """The model's float8 settings (ModelOptions.fp8): ``Fp8Config``'s values, frozen."""

    recipe: str = "tensorwise"
    grad_dtype: str = "auto"  # resolved at construction: never "auto" once built
    amax_history_len: int = 16
    margin: int = 0
    keep_bf16: tuple[str, ...] = DEFAULT_KEEP_BF16

    def __post_init__(self) -> None:
        object.__setattr__(self, "grad_dtype", grad_format(self.recipe, self.grad_dtype))

    @classmethod
    def from_config(cls, c: Fp8Config) -> Fp8Options:
        return cls(c.recipe, c.grad_dtype, c.amax_history_len, c.margin, tuple(c.keep_bf16))


def grad_format(recipe: str, grad_dtype: str) -> str:
    """dY's float8 format: ``grad_dtype`` as given, or for ``auto`` the recipe's own (torchao's and TE's
    defaults): e5m2 under one scale per tensor (tensorwise, delayed: a whole gradient's entries span more
    powers of two than e4m3's 2^-9..448 holds; e5m2 holds 2^-16..57344), e4m3 under rowwise (each row has
    its own scale, so the range is not needed, and e4m3's third mantissa bit halves every rounding error)."""
    if grad_dtype != "auto":
        return grad_dtype
    return "e4m3" if recipe == "rowwise" else "e5m2"


def compute_precision(precision: str) -> str:
    """The 16-bit precision a run computes in outside its float8 GEMMs (fp8 -> bf16; others as given)."""
    return COMPUTE_DTYPE if precision == "fp8" else precision


def check_fp8_config(precision: str, c: Fp8Config, compile_layers: bool) -> None:
    """The rules of ``train.fp8`` against the precision and the run. Every layout trains in fp8 (dense
    layers and routed experts: their amaxes span the ranks that split their tensors)."""
    if precision != "fp8":
        if c != Fp8Config():
            changed = next(k for k in Fp8Config.__dataclass_fields__ if getattr(c, k) != getattr(Fp8Config(), k))
            raise ConfigError(f"train.fp8.{changed}={getattr(c, changed)!r} with train.precision={precision}: float8 "
                              "settings apply only to train.precision=fp8 (which computes in bf16 outside its float8 "
                              "GEMMs; there is no fp8 with fp16); valid: train.precision=fp8, or drop train.fp8.*")
        return
    if c.recipe not in FP8_RECIPES:
        raise ConfigError(f"train.fp8.recipe={c.recipe!r} is unknown; valid: {format_choices(FP8_RECIPES)}")
    if c.grad_dtype not in FP8_GRAD_DTYPES:
        raise ConfigError(f"train.fp8.grad_dtype={c.grad_dtype!r} is unknown; valid: {format_choices(FP8_GRAD_DTYPES)}")
    if c.amax_history_len < 1:
        raise ConfigError(f"train.fp8.amax_history_len={c.amax_history_len} must be >= 1")
    if c.margin < 0:
        raise ConfigError(f"train.fp8.margin={c.margin} must be >= 0 (powers of two of headroom)")
    if compile_layers:
        raise ConfigError("train.compile=true with train.precision=fp8 is not yet supported (the float8 linear's "
                          "delayed-scaling state is updated in Python); valid: train.compile=false")
