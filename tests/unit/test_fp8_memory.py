"""train.precision=fp8 in the memory and cost models (autoconfig/fp8_terms.py, issue 35).

Oracles: the bytes autograd saves for one fp8 block (torch's saved-tensor hooks, exact: the float8 x8
and W8, the scales, the bf16 inputs rowwise keeps) and what its backward adds (profiler memory events:
the casts' fp32 buffers), as tests/unit/test_layer_memory.py does for bf16; the formulas by hand for
each term (sizes in bytes); the cost model's float8 GEMMs at the FP8 rate and its casts by their byte
counts; the one-line refusals (fp8 on an A100, an unknown precision to choose among). The whole-run
peaks are tests/distributed/test_memory_model.py's fp8 cases; at 1B-8B scale the rehearsal table's
(tests/unit/test_rehearsal_table.py).
"""

from __future__ import annotations

import pytest
import torch

from mpformer.autoconfig.fp8_terms import (
    CAST_BYTES_EAGER,
    delayed_state_bytes,
    fp8_layer_bytes,
    fp8_projections,
    gathered_bytes,
)
from mpformer.autoconfig.layer_memory import layer_bytes
from mpformer.core.errors import ConfigError
from mpformer.core.fp8_config import DEFAULT_KEEP_BF16, Fp8Options
from mpformer.core.layout import ParallelLayout
from mpformer.core.model_config import ModelConfig
from mpformer.testing.memory import saved_layer_bytes

S, B = 128, 2
LLAMA = ModelConfig(arch="llama", num_layers=2, hidden_size=128, num_attention_heads=8, num_kv_heads=2,
                    ffn_hidden_size=352, vocab_size=512, max_position_embeddings=S)
RECIPES = ("tensorwise", "rowwise", "delayed")


@pytest.fixture(autouse=True)
def native_kernels(monkeypatch):
    from mpformer.parallel import kernels

    monkeypatch.setenv("MPFORMER_CPU_DGRAD", "nn")
    monkeypatch.setenv("MPFORMER_CPU_ATTENTION", "native")
    kernels.process_kernels.cache_clear()
    kernels.process_attention.cache_clear()
    yield
    kernels.process_kernels.cache_clear()
    kernels.process_attention.cache_clear()


def _fp8_block(recipe: str, recompute: str = "none"):
    from mpformer.core.model_options import ModelOptions
    from mpformer.layers.linear import Linear
    from mpformer.models.fp8 import recipe_of
    from mpformer.models.transformer import Transformer

    model = Transformer(LLAMA, ModelOptions(recompute=recompute), seed=1).to(torch.bfloat16)
    for m in model.modules():
        if isinstance(m, Linear):
            m.enable_fp8(recipe_of(Fp8Options(recipe=recipe)))
    tokens = torch.randint(0, LLAMA.vocab_size, (B, S), generator=torch.Generator().manual_seed(0))
    seq = model.sequence(tokens)
    x = model.embed_tokens(tokens, seq).detach().requires_grad_()
    return model, seq, x, torch.autocast("cpu", dtype=torch.bfloat16)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_saved_bytes_are_what_autograd_keeps(recipe, recompute):
    """Every storage autograd saves in one fp8 block (parameters and rotary tables aside), exactly."""
    model, seq, x, _ = _fp8_block(recipe, recompute)
    got = saved_layer_bytes(model, seq, x, torch.bfloat16)
    want = layer_bytes(LLAMA, ParallelLayout(recompute=recompute), S, B, "fp8", fp8=Fp8Options(recipe=recipe)).saved
    assert got == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("recipe,tol", [("tensorwise", 0.01), ("rowwise", 0.05)])
def test_backward_adds_what_the_count_says(recipe, tol):
    """One fp8 block's backward peak above what was live when it began (profiler memory events) against
    the count (the bf16 backward plus the dY cast's fp32 buffers), within ``tol`` of the layer's saved
    bytes: tensorwise measured 0.2% low, rowwise 3.7% high (its preceding projection freed a bf16 input)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    model, seq, x, ctx = _fp8_block(recipe)
    with ctx:
        model.run_layers(x, range(1), seq).sum().backward()  # warm-up
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with ctx:
            out = model.run_layers(x, range(1), seq)
        grad = torch.ones_like(out)
        with torch.profiler.record_function("mark:backward"):
            pass
        out.backward(grad)
    events = prof.profiler.kineto_results.events()
    start = next(e.start_ns() for e in events if e.name() == "mark:backward")
    mem = sorted(((e.start_ns(), e.nbytes()) for e in events
                  if e.name() == "[memory]" and e.device_type() == DeviceType.CPU), key=lambda e: e[0])
    live, at_start, peak = 0, None, 0
    for t, n in mem:
        if t >= start and at_start is None:
            at_start = live
        live += n
        if t >= start:
            peak = max(peak, live)
    lb = layer_bytes(LLAMA, ParallelLayout(), S, B, "fp8", fp8=Fp8Options(recipe=recipe))
    assert abs(peak - at_start - lb.backward) <= tol * lb.saved, (peak - at_start, lb.backward, lb.saved)


MOE = ModelConfig(arch="mixtral", num_layers=2, hidden_size=128, num_attention_heads=8, num_kv_heads=2,
                  ffn_hidden_size=96, vocab_size=512, max_position_embeddings=S, mlp_kind="moe", num_experts=8,
                  num_experts_per_tok=2, moe_ffn_hidden_size=96)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_float8_experts_saved_bytes_are_what_autograd_keeps(recipe, recompute, monkeypatch):
    """One sparse block with only its routed experts in float8 (attention kept bf16): every storage autograd
    saves = the bf16 count with the experts' float8 terms (fp8_terms.py), at the real padding (the count
    uses the mean M + E (16 - 1) / 2; the routing here gives its own, read from the experts' counts)."""
    from mpformer.autoconfig.fp8_terms import fp8_expert_bytes
    from mpformer.core.model_options import ModelOptions
    from mpformer.layers.moe import Experts
    from mpformer.models.fp8 import recipe_of
    from mpformer.models.transformer import Transformer

    o = Fp8Options(recipe=recipe, keep_bf16=(*DEFAULT_KEEP_BF16, "layers.*.attn.*"))
    model = Transformer(MOE, ModelOptions(recompute=recompute), seed=1).to(torch.bfloat16)
    for m in model.modules():
        if isinstance(m, Experts):
            m.enable_fp8(recipe_of(o))
    counts: list[int] = []
    real = Experts.forward
    monkeypatch.setattr(Experts, "forward", lambda self, x_mh, c: counts.extend(c) or real(self, x_mh, c))
    tokens = torch.randint(0, MOE.vocab_size, (B, S), generator=torch.Generator().manual_seed(0))
    seq = model.sequence(tokens)
    x = model.embed_tokens(tokens, seq).detach().requires_grad_()
    got = saved_layer_bytes(model, seq, x, torch.bfloat16)
    rows, padded = sum(counts), sum(-(-c // 16) * 16 for c in counts)
    assert rows == S * B * 2 and padded > rows  # every token to 2 experts; some expert's block padded

    def net(p: float | None) -> float:
        t = fp8_expert_bytes(o, 128, 96, 8, rows, 2, recompute, padded=p)
        return t.weight_copies - t.input_saving

    want = layer_bytes(MOE, ParallelLayout(recompute=recompute), S, B, "fp8", kind="moe", fp8=o).saved
    assert got == pytest.approx(want + net(padded) - net(None), rel=1e-9)
    bf16 = layer_bytes(MOE, ParallelLayout(recompute=recompute), S, B, "bf16", kind="moe").saved
    assert (want != bf16) == (recompute == "none")  # the experts' float8 terms are counted


def test_each_term_by_its_formula():
    """h 128, q 128, kv 32 (2 kv heads of 64), f 352; 256 tokens: the four projections' inputs 1 byte an
    element instead of 2, their weights' float8 copies and two fp32 scales each, the delayed state."""
    h, q, kv, f, T = 128, 128, 32, 352, S * B
    projs = fp8_projections(LLAMA, 1, Fp8Options())
    assert [(p.name, p.k, p.n) for p in projs] == [("qkv", h, q + 2 * kv), ("o", q, h), ("up", h, 2 * f),
                                                   ("down", f, h)]
    tw = fp8_layer_bytes(projs, Fp8Options(), S, S, B)
    assert tw.input_saving == T * (h + q + h + f)
    weights = h * (q + 2 * kv) + q * h + h * 2 * f + f * h
    assert tw.weight_copies == weights + 4 * 8
    assert tw.cast_peak == 8 * T * 2 * f  # dY of up [T, 2f]: t.float() and t / scale, fp32 both
    assert tw.state == 0
    dl = fp8_layer_bytes(projs, Fp8Options(recipe="delayed", amax_history_len=16), S, S, B)
    assert dl.state == delayed_state_bytes(projs, Fp8Options(recipe="delayed")) == 4 * (3 * 16 + 3) * 4
    rw = fp8_layer_bytes(projs, Fp8Options(recipe="rowwise"), S, S, B)
    assert rw.input_saving == rw.weight_copies == 0  # the bf16 input and the parameter itself
    assert rw.cast_peak == 7 * T * 2 * f
    # fused casts (torch.compile, Transformer Engine) hold the float8 result only
    assert fp8_layer_bytes(projs, Fp8Options(), S, S, B, fused=True).cast_peak == 2 * T * 2 * f + 2 * f * h + T * h
    # sequence parallelism: the column-parallel projections save the float8 shard (s / t rows)
    sp = fp8_layer_bytes(projs, Fp8Options(), S, S / 4, B)
    assert sp.input_saving == T * (h / 4 + q + h / 4 + f)


def test_keep_bf16_patterns_take_projections_out():
    o = Fp8Options(keep_bf16=(*DEFAULT_KEEP_BF16, "layers.*.mlp.down", "layers.0.attn.q"))
    assert [p.name for p in fp8_projections(LLAMA, 1, o)] == ["o", "up"]  # q: a part of the fused qkv
    saved = {r: layer_bytes(LLAMA, ParallelLayout(), S, B, "fp8", fp8=Fp8Options(recipe="tensorwise",
                                                                                   keep_bf16=k)).saved
             for r, k in (("all", DEFAULT_KEEP_BF16), ("none", ("layers.*",)))}
    assert saved["none"] == layer_bytes(LLAMA, ParallelLayout(), S, B, "bf16").saved != saved["all"]


def test_zero3_gathers_float8_weights():
    """A layer unit [norm, qkv] gathered: the qkv weight in 1 byte an element, the norm in 2; rowwise: all 2."""
    projs = fp8_projections(LLAMA, 1, Fp8Options())
    unit = [128, 128 * 192]
    assert gathered_bytes(unit, projs, Fp8Options(), 2) == 2 * 128 + 128 * 192
    assert gathered_bytes(unit, projs, Fp8Options(recipe="rowwise"), 2) == 2 * sum(unit)


def test_zero3_forward_keeps_no_weight_copy():
    """Gathered in float8, a forward uses the unit's view (freed with the unit, gathered again for its
    backward): per micro-batch only x's scale is kept beside x8, and no weight cast adds to the peak;
    rowwise gathers bf16 and is unchanged. The layer's saved bytes drop by the float8 weights and their
    fp32 scale."""
    projs = fp8_projections(LLAMA, 1, Fp8Options())
    own, gathered = (fp8_layer_bytes(projs, Fp8Options(), S, S, B, gathered=g) for g in (False, True))
    assert gathered.weight_copies == 4 * len(projs)
    assert (gathered.input_saving, gathered.cast_peak, gathered.state) == (own.input_saving, own.cast_peak, own.state)
    # a weight cast bigger than dY's (few tokens): counted only where the forward casts its own weight
    few = fp8_layer_bytes(projs, Fp8Options(), 16, 16, 1)
    assert few.cast_peak == 8 * 128 * 2 * 352
    assert fp8_layer_bytes(projs, Fp8Options(), 16, 16, 1, gathered=True).cast_peak < few.cast_peak
    rw = Fp8Options(recipe="rowwise")
    assert fp8_layer_bytes(projs, rw, S, S, B, gathered=True) == fp8_layer_bytes(projs, rw, S, S, B)
    saved = {g: layer_bytes(LLAMA, ParallelLayout(zero=3), S, B, "fp8", sunk=True, fp8=Fp8Options(),
                            fp8_gathered=g).saved for g in (False, True)}
    assert saved[False] - saved[True] == sum(p.n * p.k + 4 for p in projs)


def test_float8_gemms_run_at_the_fp8_rate_and_casts_cost_their_bytes():
    from mpformer.autoconfig.cluster import load_cluster
    from mpformer.autoconfig.compute import gemm_time
    from mpformer.autoconfig.kernels import Gemm, layer_work

    c = load_cluster("dgx-h100", 1)
    # twice the rate, less what a GEMM of half the duration loses on the device's size curve (compute.py)
    ratio = gemm_time(c, "bf16", Gemm(8192, 8192, 8192, dtype="fp8")) / gemm_time(c, "bf16", Gemm(8192, 8192, 8192))
    assert 0.5 < ratio < 0.55, ratio
    bf16 = layer_work(LLAMA, ParallelLayout(), S, B, "bf16")
    fp8 = layer_work(LLAMA, ParallelLayout(), S, B, "fp8")
    assert [g.dtype for g in fp8.f.gemms] == ["fp8"] * 4 and all(g.dtype is None for g in bf16.f.gemms)
    T, h, q, kv, f = S * B, 128, 128, 32, 352
    xs = T * (h + q + h + f)
    ws = h * (q + 2 * kv) + q * h + h * 2 * f + f * h
    assert fp8.f.stream_bytes - bf16.f.stream_bytes == CAST_BYTES_EAGER * (xs + ws)
    dys = T * ((q + 2 * kv) + h + 2 * f + h)
    assert fp8.bi.stream_bytes - bf16.bi.stream_bytes == CAST_BYTES_EAGER * dys + 2 * ws  # dY casts, W8^T copies
    assert fp8.bw.stream_bytes - bf16.bw.stream_bytes == 2 * (dys + xs)  # dY8^T and x8^T copies


def test_float8_experts_grouped_gemms_are_priced_at_the_fp8_rate():
    """A sparse layer's two grouped GEMMs (8 experts, their rows each) go float8 unless keep_bf16 names the
    experts; their casts cost each expert's operands (rows x k, n x k, rows x n per expert, 8 of them)."""
    from mpformer.autoconfig.kernels import layer_work

    o = Fp8Options(keep_bf16=(*DEFAULT_KEEP_BF16, "layers.*.attn.*"))
    kept = Fp8Options(keep_bf16=(*o.keep_bf16, "layers.*.mlp.experts"))
    bf16 = layer_work(MOE, ParallelLayout(), S, B, "bf16", kind="moe")
    fp8 = layer_work(MOE, ParallelLayout(), S, B, "fp8", kind="moe", fp8=o)
    assert [g.dtype for g in fp8.f.gemms] == [None] * 3 + ["fp8", "fp8"]  # qkv, o, the router, the experts
    assert [g.dtype for g in layer_work(MOE, ParallelLayout(), S, B, "fp8", kind="moe", fp8=kept).f.gemms] == [None] * 5
    rows, h, f, E = fp8.f.gemms[3].m, 128, 96, 8
    assert fp8.f.gemms[3].batch == E and rows == S * B * 2 // E
    xs, ws = E * rows * (h + f), E * (2 * f * h + h * f)
    assert fp8.f.stream_bytes - bf16.f.stream_bytes == CAST_BYTES_EAGER * (xs + ws)
    assert fp8.bi.stream_bytes - bf16.bi.stream_bytes == CAST_BYTES_EAGER * E * rows * (2 * f + h) + 2 * ws


def test_amax_reductions_are_priced_at_latency_under_tp():
    from dataclasses import replace

    from mpformer.autoconfig.cluster import load_cluster
    from mpformer.autoconfig.cost import layer_times_parts
    from mpformer.autoconfig.links import _collective
    from mpformer.autoconfig.runtimes import MPFORMER
    from mpformer.autoconfig.workload import Workload

    c = load_cluster("dgx-h100", 1)

    def tp_comm(L: ParallelLayout, precision: str, recipe: str = "tensorwise") -> float:
        rt = replace(MPFORMER, fp8=Fp8Options(recipe=recipe))
        return layer_times_parts(LLAMA, L, Workload(2, 2, S, precision, runtime=rt), c)[3]

    amax = _collective(c, "all_reduce", 4.0, 2, False)
    tp2 = ParallelLayout(tp=2)  # all-reduces of the activations: bf16 either way; 3 casts per projection
    assert tp_comm(tp2, "fp8") - tp_comm(tp2, "bf16") == pytest.approx(4 * 3 * amax, rel=1e-9)
    assert tp_comm(tp2, "fp8", "rowwise") - tp_comm(tp2, "bf16") == pytest.approx(4 * 6 * amax, rel=1e-9)
    full = ParallelLayout(tp=2, recompute="full")  # the recomputed forward casts x and W again
    assert tp_comm(full, "fp8") - tp_comm(full, "bf16") == pytest.approx(4 * 5 * amax, rel=1e-9)
    # sequence parallelism: the input shards all-gathered in float8 (2 in forward, 2 in backward), 1 byte each
    sp, act = ParallelLayout(tp=2, sequence_parallel=True), S * 2 * 128 * 2
    gathers = 4 * (_collective(c, "all_gather", act / 2, 2, False) - _collective(c, "all_gather", act, 2, False))
    assert tp_comm(sp, "fp8") - tp_comm(sp, "bf16") == pytest.approx(4 * 3 * amax + gathers, rel=1e-9)


def test_fp8_on_an_a100_is_refused_in_one_line():
    from mpformer.autoconfig.cluster import load_cluster
    from mpformer.autoconfig.precision import allowed, check_precision

    a100, h100 = load_cluster("dgx-a100-80gb", 1), load_cluster("dgx-h100", 1)
    with pytest.raises(ConfigError) as e:
        check_precision(a100, "fp8")
    msg = str(e.value)
    assert "\n" not in msg and "cluster dgx-a100-80gb has no fp8 rate" in msg and "valid: fp32, bf16, fp16" in msg
    assert allowed(a100, ["bf16", "fp8"], "bf16") == ["bf16"]  # a list: fp8 left out, not an error
    assert allowed(h100, ["bf16", "fp8"], "bf16") == ["bf16", "fp8"]
    assert allowed(h100, [], "fp8") == ["fp8"]
    with pytest.raises(ConfigError, match="no fp8 rate"):
        allowed(a100, ["fp8"], "bf16")


def test_the_search_chooses_among_precisions_on_layouts_fp8_trains():
    """autoconfig.precisions=[bf16, fp8]: each searched (fp8 on every layout, float8 routed experts at any
    cp and etp too), the fastest plan's precision returned with it and in its overrides."""
    from mpformer.autoconfig.cluster import load_cluster
    from mpformer.autoconfig.precision import search_precisions
    from mpformer.autoconfig.workload import Workload
    from mpformer.cli.compose import compose_config

    m = compose_config(["model=llama-1b"]).cfg.model
    c = load_cluster("dgx-h100", 1)
    w = Workload(64, 1, 2048, "bf16")
    res, chosen = search_precisions(m, c, w, ["fp8"], fixed={"tp": 2}, top_k=3, device="cuda")
    assert chosen.precision == "fp8" and res.top and all(x.layout.tp == 2 for x in res.top)
    both, chosen = search_precisions(m, c, w, ["bf16", "fp8"], fixed={}, top_k=3, device="cuda")
    assert both.top[0].precision == chosen.precision
    assert f"train.precision={chosen.precision}" in both.top[0].overrides()
    moe = compose_config(["model=mixtral-8x7b"]).cfg.model
    res, chosen = search_precisions(moe, load_cluster("dgx-h100", 2), Workload(64, 1, 4096, "bf16"), ["fp8"],
                                    fixed={"cp": 2, "etp": 2, "tp": 2}, top_k=3, device="cuda")
    assert chosen.precision == "fp8" and res.top and all((x.layout.cp, x.layout.etp) == (2, 2) for x in res.top)
