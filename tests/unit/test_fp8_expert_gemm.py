"""The routed experts' float8 GEMMs (layers/fp8_expert_gemm.py, issue 35): per expert, forward, dgrad
and wgrad equal an emulated reference (torch's float8 cast, fp32 matmul, scales from their definitions)
within 1e-6 of the largest element, with uneven counts, an expert of no tokens and rows padded to 16.

Both methods run here. ``loop`` is the CPU's path (``_scaled_mm`` per expert). ``grouped`` is CUDA's
(``torch._scaled_grouped_mm``, which has no CPU kernel in torch 2.13): its calls go to ``fake_grouped_mm``
below, a plain-torch oracle that first runs torch's own meta kernel on the same arguments (so every
layout, stride, dtype and scale-shape rule of the CUDA kernel is checked) and then computes the
definition per group. The operands and scales the grouped path builds are therefore the GPU's.
"""

from __future__ import annotations

import pytest
import torch

from mpformer.layers.fp8 import TINY, DelayedScalingState, Float8Recipe
from mpformer.layers.fp8_expert_gemm import (
    ExpertScalingState,
    Groups,
    choose_fp8_method,
    fp8_expert_mlp,
    fp8_grouped_linear,
    pad_rows,
)

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
FMAX = {E4: 448.0, E5: 57344.0}
GRAD = {"e4m3": E4, "e5m2": E5}
COUNTS = [5, 0, 37, 16]
REAL_GROUPED_MM = torch._scaled_grouped_mm  # uneven, one expert without tokens, one already a multiple of 16
K, N = 64, 48


# --- the oracles ----------------------------------------------------------------------------------------

def ref_scale(t: torch.Tensor, dtype: torch.dtype, dim: int | None = None) -> torch.Tensor:
    amax = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    return torch.where(amax > 0, torch.clamp(amax.float() / FMAX[dtype], min=TINY), torch.ones_like(amax))


def ref_cast(t: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (t.float() / s).clamp(-FMAX[dtype], FMAX[dtype]).to(dtype).float()


def ref_gemm(a, b, da, db, rowwise, sa=None, sb=None) -> torch.Tensor:
    """a [M, K] @ b [K, N]: per tensor, or per row of a and column of b (amax along K)."""
    sa = ref_scale(a, da, 1 if rowwise else None) if sa is None else sa
    sb = ref_scale(b, db, 0 if rowwise else None) if sb is None else sb
    return (ref_cast(a, sa, da) @ ref_cast(b, sb, db)) * sa * sb


def fake_grouped_mm(a, b, scale_a, scale_b, offs=None, bias=None, scale_result=None, out_dtype=None,
                    use_fast_accum=False):
    """torch._scaled_grouped_mm on CPU: the meta kernel's checks, then the definition per group."""
    REAL_GROUPED_MM(a.to("meta"), b.to("meta"), scale_a.to("meta"), scale_b.to("meta"),
                             offs=offs.to("meta"), out_dtype=out_dtype)
    ends = offs.tolist()
    starts = [0, *ends[:-1]]
    if b.dim() == 3:  # [Mp, K] x [E, K, N]: scales [Mp] and [E, N]
        out = torch.zeros(a.shape[0], b.shape[-1])
        for e, (s, t) in enumerate(zip(starts, ends, strict=True)):
            out[s:t] = (a[s:t].float() * scale_a[s:t, None]) @ (b[e].float() * scale_b[e][None, :])
        return out.to(out_dtype)
    n, k, E = a.shape[0], b.shape[1], len(ends)  # [N, Mp] x [Mp, K] over offs: scales [E*N] and [E*K]
    out = torch.zeros(E, n, k)
    sa, sb = scale_a.view(E, n), scale_b.view(E, k)
    for e, (s, t) in enumerate(zip(starts, ends, strict=True)):
        out[e] = (a[:, s:t].float() * sa[e][:, None]) @ (b[s:t].float() * sb[e][None, :])
    return out.to(out_dtype)


@pytest.fixture
def grouped_kernel(monkeypatch):
    monkeypatch.setattr(torch, "_scaled_grouped_mm", fake_grouped_mm)


def assert_matches(y: torch.Tensor, ref: torch.Tensor, rel: float = 1e-6) -> None:
    """fp32: within rel * max|ref|; bf16: between the bf16 roundings of ref -/+ that tolerance."""
    assert not torch.isnan(y).any()
    tol = rel * ref.abs().max().item()
    if y.dtype == torch.float32:
        assert (y - ref).abs().max().item() <= tol, ((y - ref).abs().max().item(), tol)
        return
    lo, hi = (ref - tol).to(y.dtype), (ref + tol).to(y.dtype)
    assert bool(((y >= lo) & (y <= hi)).all()), (y.float() - ref).abs().max().item()


def data(counts=COUNTS, seed=0):
    g = torch.Generator().manual_seed(seed)
    m, E = sum(counts), len(counts)
    # each expert's rows and weight on their own scale: a shared scale would hide a per-expert mistake
    x = torch.randn(m, K, generator=g) * torch.rand(m, 1, generator=g) * 4
    w = torch.randn(E, N, K, generator=g) * (0.01 + torch.rand(E, 1, 1, generator=g))
    dy = torch.randn(m, N, generator=g) * 1e-3
    return x, w, dy


def blocks(t: torch.Tensor, counts=COUNTS) -> list[torch.Tensor]:
    return list(t.split(counts))


def run(x, w, dy, recipe, method, out_dtype, counts=COUNTS, state=None):
    """fp8_grouped_linear on rows padded per expert; the real rows of y, dx and dw."""
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    xp, g, dest = pad_rows(x, counts)
    y = fp8_grouped_linear(xp, w, g, recipe, state, method=method, out_dtype=out_dtype)
    y = y if dest is None else y.index_select(0, dest)
    y.backward(dy.to(y.dtype))
    return y.detach(), x.grad, w.grad


# --- each recipe against the oracle ---------------------------------------------------------------------

METHODS = [("loop", "e5m2", torch.float32), ("loop", "e4m3", torch.float32), ("loop", "e5m2", torch.bfloat16),
           ("grouped", "e4m3", torch.bfloat16)]


@pytest.mark.parametrize("method,grad,out_dtype", METHODS)
@pytest.mark.parametrize("name", ["tensorwise", "rowwise"])
def test_per_expert_gemms_match_reference(name, method, grad, out_dtype, monkeypatch):
    monkeypatch.setattr(torch, "_scaled_grouped_mm", fake_grouped_mm)
    x, w, dy = data()
    rowwise, gdt = name == "rowwise", GRAD[grad]
    y, dx, dw = run(x, w, dy, Float8Recipe(name, grad), method, out_dtype)
    for e, (xe, dye, ye, dxe) in enumerate(zip(blocks(x), blocks(dy), blocks(y), blocks(dx), strict=True)):
        if xe.shape[0] == 0:
            assert float(dw[e].abs().max()) == 0.0  # no tokens, no gradient
            continue
        # dy reaches the GEMMs in out_dtype; dx and dw come back in the parameters' dtype (fp32 here),
        # from GEMMs that rounded to out_dtype: compared in out_dtype
        dye = dye.to(out_dtype).float()
        assert_matches(ye, ref_gemm(xe, w[e].t(), E4, E4, rowwise))
        assert_matches(dxe.to(out_dtype), ref_gemm(dye, w[e], gdt, E4, rowwise))
        assert_matches(dw[e].to(out_dtype), ref_gemm(dye.t(), xe, gdt, E4, rowwise))


def test_grouped_and_loop_give_the_same_operands(grouped_kernel):
    """The same float8 operands and scales reach both kernels: at bf16 out their results agree to a bf16
    rounding of the fp32 sums (which each kernel may sum in its own order)."""
    x, w, dy = data(seed=1)
    recipe = Float8Recipe("tensorwise", "e4m3")
    a = run(x, w, dy, recipe, "loop", torch.bfloat16)
    b = run(x, w, dy, recipe, "grouped", torch.bfloat16)
    for u, v in zip(a, b, strict=True):
        torch.testing.assert_close(u.float(), v.float(), rtol=8e-3, atol=1e-6 * float(v.abs().max()))


def amax(t: torch.Tensor) -> torch.Tensor:
    return t.abs().amax() if t.numel() else torch.zeros(())


def test_delayed_scales_are_per_expert_histories():
    """Each expert's scales follow layers/fp8.py DelayedScalingState fed that expert's amaxes alone; the
    GEMMs then match the reference cast with those scales."""
    recipe = Float8Recipe("delayed", "e5m2", history_len=4)
    E = len(COUNTS)
    hist, scales = torch.zeros(E, 3, 4), torch.ones(E, 3)
    state = ExpertScalingState(recipe, hist, scales)
    refs = [DelayedScalingState(recipe) for _ in range(E)]
    for step in range(3):
        x, w, dy = data(seed=10 + step)
        before = [(r.scale_for("input", amax(xe)), r.scale_for("weight", w[e].abs().amax()))
                  for e, (r, xe) in enumerate(zip(refs, blocks(x), strict=True))]
        y, _, _ = run(x, w, dy, recipe, "loop", torch.float32, state=state)
        for e, (r, xe, dye) in enumerate(zip(refs, blocks(x), blocks(dy), strict=True)):
            sx, sw = before[e]
            if xe.shape[0]:
                assert_matches(blocks(y)[e], ref_gemm(xe, w[e].t(), E4, E4, False, sx, sw))
            r.record("input", amax(xe))
            r.record("weight", w[e].abs().amax())
            r.record("grad_output", amax(dye))
            torch.testing.assert_close(hist[e], r.amax_history, rtol=0, atol=0)
            torch.testing.assert_close(scales[e], r.scales, rtol=0, atol=0)


def test_padding_rows_and_groups():
    x = torch.randn(sum(COUNTS), 8)
    xp, g, dest = pad_rows(x, COUNTS)
    assert g.counts == (16, 0, 48, 16) and xp.shape == (80, 8)
    assert g.offs.tolist() == [16, 16, 64, 80] and g.ids.tolist() == [0] * 16 + [2] * 48 + [3] * 16
    torch.testing.assert_close(xp.index_select(0, dest), x, rtol=0, atol=0)
    added = torch.ones(80, dtype=torch.bool).index_fill(0, dest, False)
    assert int(added.sum()) == 80 - sum(COUNTS) and float(xp[added].abs().max()) == 0.0
    assert g.amax(xp).tolist()[1] == 0.0
    same, g2, none = pad_rows(torch.randn(32, 8), [16, 0, 16])
    assert none is None and same.shape == (32, 8) and g2.counts == (16, 0, 16)
    assert [b for b in Groups.of([16, 0, 32], x.device).bounds] == [(0, 0, 16), (2, 16, 48)]


def test_grouped_kernel_is_cuda_only():
    """What torch 2.13 offers (measured): _scaled_grouped_mm has a meta and a CUDA kernel, no CPU one;
    the grouped path is chosen on CUDA for e4m3 gradients only (the kernel takes no e5m2)."""
    a, b = torch.zeros(16, 16, dtype=E4), torch.zeros(1, 16, 16, dtype=E4).transpose(-2, -1)
    with pytest.raises(NotImplementedError):
        torch._scaled_grouped_mm(a, b, torch.ones(16), torch.ones(1, 16), offs=torch.tensor([16], dtype=torch.int32),
                                 out_dtype=torch.bfloat16)
    assert choose_fp8_method("cpu", Float8Recipe("tensorwise", "e4m3"), 64, 32) == "loop"
    assert choose_fp8_method("cuda", Float8Recipe("tensorwise", "e4m3"), 64, 32) == "grouped"
    assert choose_fp8_method("cuda", Float8Recipe("rowwise", "e4m3"), 64, 32) == "grouped"
    assert choose_fp8_method("cuda", Float8Recipe("tensorwise", "e5m2"), 64, 32) == "loop"
    assert choose_fp8_method("cuda", Float8Recipe("tensorwise", "e4m3"), 64, 24) == "loop"


@pytest.mark.parametrize("name", ["tensorwise", "rowwise", "delayed"])
def test_grouped_path_passes_the_cuda_kernels_checks_on_meta(name):
    """The whole expert MLP, forward and backward, through torch's own meta kernels of _scaled_grouped_mm
    (the rules of the CUDA kernel: layouts, strides, dtypes, scale shapes): nothing faked."""
    E, h, f = 4, 64, 32
    recipe = Float8Recipe(name, "e4m3", history_len=4)
    x = torch.randn(sum(COUNTS), h, device="meta", dtype=torch.bfloat16, requires_grad=True)
    w_up = torch.randn(E, 2 * f, h, device="meta", dtype=torch.bfloat16, requires_grad=True)
    w_down = torch.randn(E, h, f, device="meta", dtype=torch.bfloat16, requires_grad=True)
    states = None
    if name == "delayed":
        hist, sc = torch.zeros(E, 2, 3, 4, device="meta"), torch.ones(E, 2, 3, device="meta")
        states = tuple(ExpertScalingState(recipe, hist[:, i], sc[:, i]) for i in range(2))
    y = fp8_expert_mlp(x, COUNTS, w_up, w_down, recipe, states, method="grouped")
    assert y.shape == (sum(COUNTS), h) and y.dtype == torch.bfloat16
    y.sum().backward()
    assert w_up.grad.shape == w_up.shape and w_down.grad.shape == w_down.shape and x.grad.shape == x.shape


def test_expert_mlp_methods_agree_and_empty_expert_has_no_gradient(grouped_kernel):
    E, h, f = 4, 32, 16
    torch.manual_seed(0)
    x = torch.randn(sum(COUNTS), h, dtype=torch.bfloat16)
    w_up, w_down = torch.randn(E, 2 * f, h) * 0.1, torch.randn(E, h, f) * 0.1
    outs = []
    for method in ("loop", "grouped"):
        ps = [t.clone().to(torch.bfloat16).requires_grad_() for t in (x, w_up, w_down)]
        y = fp8_expert_mlp(ps[0], COUNTS, ps[1], ps[2], Float8Recipe("tensorwise", "e4m3"), method=method)
        y.float().square().sum().backward()
        outs.append([y.detach().float(), *(p.grad.float() for p in ps)])
        assert float(ps[1].grad[1].abs().max()) == 0.0 and float(ps[2].grad[1].abs().max()) == 0.0
    for u, v in zip(*outs, strict=True):
        torch.testing.assert_close(u, v, rtol=2e-2, atol=1e-3 * float(v.abs().max()))


def test_bad_calls_are_named():
    x, w, _ = data()
    xp, g, _ = pad_rows(x, COUNTS)
    with pytest.raises(ValueError, match="delayed recipe needs"):
        fp8_grouped_linear(xp, w, g, Float8Recipe("delayed"))
    with pytest.raises(ValueError, match="e4m3 gradients"):
        fp8_grouped_linear(xp, w, g, Float8Recipe("tensorwise", "e5m2"), method="grouped")
    with pytest.raises(ValueError, match="counts sum"):
        fp8_expert_mlp(x[:3], COUNTS, torch.zeros(4, 2 * N, K), torch.zeros(4, K, N), Float8Recipe(), method="loop")
