"""FP8 linear numerics (issue 35 must-hold): each recipe's forward, dX and dW equal an emulated reference
within 1e-6 relative, and the scales follow their definitions on crafted tensors.

The oracle is written out here, plainly, from torch's own float8 cast and an fp32 matmul (not
``_scaled_mm``): scale = amax / fmax (1 for amax 0), cast = saturate(t / scale).to(fp8), GEMM of the
upcast operands in fp32, times the scales, rounded to the output dtype. "Within 1e-6 relative" means:
the kernel's fp32 result is within 1e-6 * max|ref| of the reference; a bf16 result lies between the
bf16 roundings of ref -/+ that tolerance (rounding is monotonic, so a kernel whose fp32 sum differs
from ours in the last bit may round the other way, and no further)."""

from __future__ import annotations

import pytest
import torch

from mpformer.layers.fp8 import (
    TINY,
    DelayedScalingState,
    Float8Recipe,
    cast_to_fp8,
    check_fp8_dims,
    tensorwise_scale,
)
from mpformer.layers.fp8_linear import fp8_linear
from mpformer.layers.linear import WeightGradStore

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
REF_FMAX = {E4: 448.0, E5: 57344.0}
GRAD = {"e4m3": E4, "e5m2": E5}
M, K, N = 32, 64, 48


# --- the oracle ---------------------------------------------------------------------------------------

def ref_scale(t: torch.Tensor, dtype: torch.dtype, dim: int | None = None) -> torch.Tensor:
    amax = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    return torch.where(amax > 0, torch.clamp(amax.float() / REF_FMAX[dtype], min=TINY), torch.ones_like(amax))


def ref_cast(t: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    fmax = REF_FMAX[dtype]
    return (t.float() / s).clamp(-fmax, fmax).to(dtype).float()


def ref_gemm(a, b, da, db, rowwise=False, sa=None, sb=None) -> torch.Tensor:
    """a [M, K] @ b [K, N], each cast with its scale (given, or from its amax: whole tensor or rowwise)."""
    sa = ref_scale(a, da, 1 if rowwise else None) if sa is None else sa
    sb = ref_scale(b, db, 0 if rowwise else None) if sb is None else sb
    return (ref_cast(a, sa, da) @ ref_cast(b, sb, db)) * sa * sb


def assert_matches(y: torch.Tensor, ref: torch.Tensor, rel: float = 1e-6) -> None:
    assert not torch.isnan(y).any()
    tol = rel * ref.abs().max().item()
    if y.dtype == torch.float32:
        assert (y - ref).abs().max().item() <= tol, ((y - ref).abs().max().item(), tol)
        return
    lo, hi = (ref - tol).to(y.dtype), (ref + tol).to(y.dtype)
    assert bool(((y >= lo) & (y <= hi)).all()), (y.float() - ref).abs().max().item()


def run(x, w, dy, recipe, state=None, out_dtype=torch.bfloat16, bias=None):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8_linear(x, w, recipe, state, bias=bias, out_dtype=out_dtype)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def data(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(M, K, generator=g) * 3, torch.randn(N, K, generator=g) * 0.05,
            torch.randn(M, N, generator=g) * 1e-3)


# --- each recipe against the oracle -------------------------------------------------------------------

@pytest.mark.parametrize(("name", "out_dtype"), [("tensorwise", torch.bfloat16), ("tensorwise", torch.float32),
                                                  ("rowwise", torch.bfloat16)])  # rowwise: bf16 only (CUDA's)
@pytest.mark.parametrize("grad", ["e4m3", "e5m2"])
def test_dynamic_recipes_match_reference(name, grad, out_dtype):
    x, w, dy = data()
    recipe, gd, rw = Float8Recipe(name=name, grad=grad), GRAD[grad], name == "rowwise"
    dy = dy.to(out_dtype).float()  # the gradient of a bf16 output arrives in bf16
    y, dx, dw = run(x, w, dy, recipe, out_dtype=out_dtype)
    assert_matches(y, ref_gemm(x, w.t(), E4, E4, rw))
    # backward outputs come back in the parameters' / input's dtype (fp32 here) from an out_dtype GEMM
    assert_matches(dx.to(out_dtype), ref_gemm(dy, w, gd, E4, rw))
    assert_matches(dw.to(out_dtype), ref_gemm(dy.t(), x, gd, E4, rw))


def test_rowwise_refuses_fp32_output_and_the_layer_casts_it_up():
    """CUDA's rowwise-scaled GEMM writes bf16 only: fp8_linear refuses fp32 in one line; a layer asked for
    fp32 outside autocast computes in bf16 and casts up (what the GPU can run)."""
    x, w, _ = data()
    with pytest.raises(ValueError, match=r"rowwise recipe gives bf16.*valid: out_dtype=torch\.bfloat16"):
        fp8_linear(x, w, Float8Recipe(name="rowwise"), out_dtype=torch.float32)
    from mpformer.layers.linear import Linear

    layer = Linear(K, N, bias=False)
    layer.enable_fp8(Float8Recipe(name="rowwise"))
    y = layer(x)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, fp8_linear(x, layer.weight, Float8Recipe(name="rowwise")).float(), rtol=0, atol=0)


def test_bias_and_leading_dims():
    x, w, dy = data(1)
    b = torch.randn(N, requires_grad=True)
    x3 = x.reshape(2, M // 2, K).requires_grad_()
    y = fp8_linear(x3, w, Float8Recipe(), bias=b, out_dtype=torch.float32)
    assert y.shape == (2, M // 2, N)
    y.backward(dy.reshape(2, M // 2, N))
    assert_matches(y.reshape(M, N) - b.detach(), ref_gemm(x, w.t(), E4, E4), rel=1e-5)
    torch.testing.assert_close(b.grad, dy.sum(0))
    assert x3.grad.shape == x3.shape


def test_delayed_scaling_history():
    """The scale at step t comes from the history of steps < t (at the first use, from the tensor's own
    amax); the history rolls (newest first, the oldest of H dropped); scale = max(history) / fmax."""
    recipe = Float8Recipe(name="delayed", grad="e5m2", history_len=2)
    state = DelayedScalingState(recipe)
    hist: dict[str, list[float]] = {"input": [], "weight": [], "grad_output": []}
    fmt = {"input": E4, "weight": E4, "grad_output": E5}

    def scale(role, now):
        past = hist[role][:2]
        return ref_scale(torch.tensor(max(past)) if past else now, fmt[role])

    for t, mag in enumerate([1.0, 100.0, 0.01, 5.0]):
        x, w, dy = data(t)
        x, dy = x * mag, dy * mag
        # dY arrives in bf16 (the output's dtype): its amax is the bf16 one
        sx, sw, sdy = scale("input", x), scale("weight", w), scale("grad_output", dy.to(torch.float32))
        if t == 0:
            assert sx.item() == ref_scale(x, E4).item() and sx.item() != 1.0
        y, dx, dw = run(x, w, dy, recipe, state, out_dtype=torch.float32)
        assert_matches(y, ref_gemm(x, w.t(), E4, E4, sa=sx, sb=sw))
        assert_matches(dx, ref_gemm(dy, w, E5, E4, sa=sdy, sb=sw))
        assert_matches(dw, ref_gemm(dy.t(), x, E5, E4, sa=sdy, sb=sx))
        for role, tt in (("input", x), ("weight", w), ("grad_output", dy)):
            hist[role].insert(0, tt.abs().max().item())
        assert state.amax_history[0].tolist() == (hist["input"] + [0.0])[:2]
    # the state's next scale is the definition's, from the window's max
    assert state.scale("input").item() == scale("input", x).item()
    assert hist["input"][2] == max(hist["input"])  # step 1's amax (x * 100) has left the window of 2


def test_delayed_state_round_trip():
    recipe = Float8Recipe(name="delayed", history_len=4, margin=1)
    a, b = DelayedScalingState(recipe), DelayedScalingState(recipe)
    for t in range(3):
        run(*data(t), recipe, a)
    sd = a.state_dict()
    b.load_state_dict({k: v.clone() for k, v in sd.items()})
    assert all(torch.equal(sd[k], b.state_dict()[k]) for k in sd)
    ya, dxa, dwa = run(*data(9), recipe, a)
    yb, dxb, dwb = run(*data(9), recipe, b)
    assert torch.equal(ya, yb) and torch.equal(dxa, dxb) and torch.equal(dwa, dwb)
    # margin: scale = amax * 2**margin / fmax
    assert a.scale("weight").item() == pytest.approx(a.amax_history[1].max().item() * 2 / 448, rel=1e-7)
    with pytest.raises(ValueError, match="history_len"):
        DelayedScalingState(Float8Recipe(name="delayed", history_len=8)).load_state_dict(sd)


# --- crafted tensors ----------------------------------------------------------------------------------

def test_zeros_scale_one_no_nan():
    x, w, dy = torch.zeros(M, K), torch.zeros(N, K), torch.zeros(M, N)
    assert tensorwise_scale(x, E4).item() == 1.0
    for name in ("tensorwise", "rowwise"):
        y, dx, dw = run(x, w, dy, Float8Recipe(name=name))
        for t in (y, dx, dw):
            assert not torch.isnan(t).any() and not t.any()


def test_single_huge_value():
    x, w, dy = data(2)
    x = x * 1e-2
    x[3, 5] = 1.0e4
    s = tensorwise_scale(x, E4)
    assert s.item() == (torch.tensor(1.0e4) / 448).item()  # amax / 448 exactly, in fp32
    x8 = cast_to_fp8(x, s, E4)
    assert x8[3, 5].float().item() == 448.0
    assert torch.equal(x8.float(), (x / s).to(E4).float())  # the rest: rounded (most flushed to 0) as .to does
    assert (x8.float() == 0).sum() > M * K // 2
    y, dx, dw = run(x, w, dy, Float8Recipe(name="tensorwise"), out_dtype=torch.float32)
    assert_matches(y, ref_gemm(x, w.t(), E4, E4))
    assert_matches(dx, ref_gemm(dy, w, E5, E4))
    assert_matches(dw, ref_gemm(dy.t(), x, E5, E4))


def test_e5m2_gradient_huge_value_saturates_not_inf():
    x, w, dy = data(3)
    dy[0, 0] = 1.0e5
    s = tensorwise_scale(dy, E5)
    assert s.item() == (torch.tensor(1.0e5) / 57344).item()
    assert cast_to_fp8(dy, s * 0.5, E5).float().abs().max().item() == 57344.0  # a too-small scale saturates
    y, dx, dw = run(x, w, dy, Float8Recipe(grad="e5m2"), out_dtype=torch.float32)
    assert_matches(y, ref_gemm(x, w.t(), E4, E4))
    assert_matches(dx, ref_gemm(dy, w, E5, E4))
    assert_matches(dw, ref_gemm(dy.t(), x, E5, E4))


def test_denormals():
    # amax 448 -> scale 1: e4m3's subnormals are k * 2**-9 below 2**-6; 2**-10 ties to even (0),
    # 3 * 2**-11 rounds up to 2**-9, 2**-7 is exact
    x = torch.zeros(M, K)
    x[0, :4] = torch.tensor([448.0, 2.0**-7, 2.0**-10, 3 * 2.0**-11])
    s = tensorwise_scale(x, E4)
    assert s.item() == 1.0
    assert cast_to_fp8(x, s, E4)[0, :4].float().tolist() == [448.0, 2.0**-7, 0.0, 2.0**-9]
    _, w, dy = data(4)
    y, _, dw = run(x, w, dy, Float8Recipe(), out_dtype=torch.float32)
    assert_matches(y, ref_gemm(x, w.t(), E4, E4))
    assert_matches(dw, ref_gemm(dy.t(), x, E5, E4))
    # a tensor of fp32 denormals: scale floored at fp32's smallest normal, no inf or nan
    tiny_x = torch.full((M, K), 1e-40)
    assert tensorwise_scale(tiny_x, E4).item() == TINY
    y, _, dw = run(tiny_x, w, dy, Float8Recipe(), out_dtype=torch.float32)
    assert torch.isfinite(y).all() and torch.isfinite(dw).all()
    # y ~ 1e-41 lies in fp32's own denormal range, where a result is exact only to fp32's absolute
    # spacing 2**-149 (the kernel multiplies the two scales first, the oracle one at a time): a bound
    # in those units, not a relative one
    assert (y - ref_gemm(tiny_x, w.t(), E4, E4)).abs().max().item() <= 64 * 2.0**-149
    for name in ("rowwise", "tensorwise"):  # a row of denormals beside normal rows
        xr = torch.randn(M, K)
        xr[1] = 2.0**-12
        out = torch.bfloat16 if name == "rowwise" else torch.float32
        recipe = Float8Recipe(name=name)  # rowwise: e4m3 gradients (grad "auto"), tensorwise e5m2
        y, _dx, dw = run(xr, w, dy.to(out).float(), recipe, out_dtype=out)
        assert_matches(y, ref_gemm(xr, w.t(), E4, E4, name == "rowwise"))
        assert_matches(dw.to(out), ref_gemm(dy.to(out).float().t(), xr, recipe.dtype("grad_output"), E4,
                                             name == "rowwise"))


# --- the split backward and the checks ----------------------------------------------------------------

@pytest.mark.parametrize("name", ["tensorwise", "rowwise", "delayed"])
def test_split_weight_grad_matches_combined(name):
    recipe = Float8Recipe(name=name)
    x, w, dy = data(5)
    state = DelayedScalingState(recipe) if name == "delayed" else None
    _, dx_ref, dw_ref = run(x, w, dy, recipe, DelayedScalingState(recipe) if state else None)
    store, xx, ww = WeightGradStore(), x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8_linear(xx, ww, recipe, state, store=store)
    with store.capture("mb0"):
        y.backward(dy)
    assert ww.grad is None and torch.equal(xx.grad, dx_ref)
    store.run("mb0")
    assert torch.equal(ww.grad, dw_ref)


def test_dimension_checks():
    check_fp8_dims("layers.0.mlp.fc1", 64, 256)
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.qkv has out_features=200"):
        check_fp8_dims("layers.0.attn.qkv", 64, 200)
    with pytest.raises(ValueError, match="30 tokens"):
        fp8_linear(torch.randn(30, K), torch.randn(N, K), Float8Recipe())
    with pytest.raises(ValueError, match=r"train\.fp8\.recipe='blockwise'"):
        Float8Recipe(name="blockwise")
    with pytest.raises(ValueError, match="DelayedScalingState"):
        fp8_linear(torch.randn(M, K), torch.randn(N, K), Float8Recipe(name="delayed"))


def test_delayed_scaling_ignores_non_finite_amax_and_no_grad_forwards():
    """An overflowed use is recorded as 0 (its inf would make every scale after it inf for H steps); a
    forward under no_grad (validation, evaluation) records nothing."""
    recipe = Float8Recipe(name="delayed", history_len=4)
    state = DelayedScalingState(recipe)
    state.record("input", torch.tensor(2.0))
    state.record("input", torch.tensor(float("inf")))
    state.record("input", torch.tensor(float("nan")))
    assert state.amax_history[0].tolist() == [0.0, 0.0, 2.0, 0.0]
    assert state.scale("input").item() == ref_scale(torch.tensor(2.0), E4).item()
    x, w, _ = data(1)
    before = state.amax_history.clone()
    with torch.no_grad():
        fp8_linear(x, w, recipe, state)
    assert torch.equal(state.amax_history, before)
