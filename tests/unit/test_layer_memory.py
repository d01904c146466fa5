"""The memory model's per-layer counts (autoconfig/layer_memory.py) against what autograd really keeps.

Oracle: torch's saved-tensor hooks on one block of mpformer's Transformer (every distinct storage
autograd saves for backward, the parameters and the rotary tables excepted: those are not the
layer's, the tables are shared by every layer of a micro-batch), in fp32 and in bf16 under autocast
(as the trainer runs it), for GPT-2 (LayerNorm, GeLU, biases) and Llama (RMSNorm with fp32
statistics, SwiGLU, GQA, RoPE) blocks, under each recompute mode. Exact to 1e-9 relative: the count is op by op. Also
what one block's backward adds above what it keeps (profiler memory events), and the bucket
arithmetic of the walk (step_memory.py) against the engine's own (core/buffers.py).
"""

from __future__ import annotations

import pytest
import torch

from mpformer.autoconfig.layer_memory import Shape, layer_bytes, norm_bytes, recompute_bytes
from mpformer.autoconfig.memory import layer_param_sizes, layer_params_per_rank, layer_part_sizes
from mpformer.autoconfig.step_memory import ReductionSpec, Unit, buckets
from mpformer.core.buffers import plan_buckets
from mpformer.core.layout import ParallelLayout
from mpformer.core.model_config import ModelConfig
from mpformer.core.model_options import ModelOptions

S, B = 128, 2
LLAMA = ModelConfig(arch="llama", num_layers=2, hidden_size=128, num_attention_heads=8, num_kv_heads=2,
                    ffn_hidden_size=352, vocab_size=512, max_position_embeddings=S)
GPT2 = ModelConfig(arch="gpt2", num_layers=2, hidden_size=128, num_attention_heads=4, ffn_hidden_size=512,
                   vocab_size=512, max_position_embeddings=S, activation="gelu_tanh", attention_bias=True,
                   mlp_bias=True, tie_embeddings=True)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.fixture(autouse=True)
def native_kernels(monkeypatch):
    """The native CPU paths (as on a GPU): no W^T copies, no fp32 attention cores (parallel/kernels.py)."""
    from mpformer.parallel import kernels

    monkeypatch.setenv("MPFORMER_CPU_DGRAD", "nn")
    monkeypatch.setenv("MPFORMER_CPU_ATTENTION", "native")
    kernels.process_kernels.cache_clear()
    kernels.process_attention.cache_clear()
    yield
    kernels.process_kernels.cache_clear()
    kernels.process_attention.cache_clear()


def _block(cfg: ModelConfig, precision: str, recompute: str):
    from mpformer.models.transformer import Transformer

    dtype = DTYPES[precision]
    model = Transformer(cfg, ModelOptions(recompute=recompute), seed=1).to(dtype)
    tokens = torch.randint(0, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(0))
    seq = model.sequence(tokens)
    x = model.embed_tokens(tokens, seq).detach().requires_grad_()
    ctx = torch.autocast("cpu", dtype=dtype) if dtype != torch.float32 else torch.autocast("cpu", enabled=False)
    return model, seq, x, ctx


def _saved_bytes(cfg: ModelConfig, precision: str, recompute: str) -> int:
    model, seq, x, ctx = _block(cfg, precision, recompute)
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    skip |= {t.untyped_storage().data_ptr() for t in (seq.rope or ())}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with ctx, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.run_layers(x, range(1), seq)
    return sum(seen.values())


@pytest.mark.parametrize("precision,autocast", [("fp32", False), ("bf16", False), ("bf16", True)])
def test_rmsnorm_keeps_its_input_and_the_row_statistics(precision, autocast):
    """RMSNorm alone: autograd keeps its input as it came and the fp32 1/rms rows, no fp32 copy (the
    model's norm_bytes, exactly); under autocast with an fp32 gain too."""
    from mpformer.layers.norm import RMSNorm

    dtype = DTYPES[precision]
    norm = RMSNorm(LLAMA.hidden_size, dtype=dtype if not autocast else torch.float32)
    x = torch.randn(S, B, LLAMA.hidden_size, dtype=dtype, requires_grad=True)
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() != norm.weight.untyped_storage().data_ptr():
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    with torch.autocast("cpu", dtype=dtype, enabled=autocast), hooks:
        norm(x)
    shape = Shape(S, S, B, LLAMA.hidden_size, 0, 0, 0, 0, 0)
    assert sum(seen.values()) == norm_bytes(LLAMA, shape, x.element_size())


@pytest.mark.parametrize("cfg", [LLAMA, GPT2], ids=["llama", "gpt2"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_saved_bytes_are_what_autograd_keeps(cfg, precision, recompute):
    L = ParallelLayout(recompute=recompute)
    want = layer_bytes(cfg, L, S, B, precision).saved
    if cfg.norm_type == "layernorm" and precision == "bf16" and recompute != "full":
        # torch's CPU LayerNorm keeps its mean and 1/std rows in a 16-bit input's dtype, CUDA's (the model's)
        # in fp32: two norms, two rows each, 2 bytes less a position
        want -= 2 * 2 * (4 - 2) * S * B
    assert _saved_bytes(cfg, precision, recompute) == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_full_recompute_brings_the_layer_back(precision):
    """In a recomputed layer's backward its activations live again; the input it kept is one of them
    (the first norm keeps the input itself, RMSNorm and LayerNorm alike, in every precision)."""
    for cfg in (LLAMA, GPT2):
        none = layer_bytes(cfg, ParallelLayout(), S, B, precision).saved
        full = layer_bytes(cfg, ParallelLayout(recompute="full"), S, B, precision).saved
        assert recompute_bytes(cfg, ParallelLayout(recompute="full"), S, B, precision) == pytest.approx(none - full)


class _Sink:
    """ZeRO-3's gradient sink (optim/engine.py) reduced to its buffers: one preallocated per parameter."""

    def __init__(self, params) -> None:
        self.buffers = {id(p): torch.zeros_like(p) for p in params}

    def grad_buffer(self, p: torch.Tensor) -> torch.Tensor:
        return self.buffers[id(p)]

    def grad_arrived(self, p: torch.Tensor) -> None:
        pass


@pytest.mark.parametrize("cfg,precision,tol,sunk", [(LLAMA, "fp32", 0.01, False), (LLAMA, "bf16", 0.1, False),
                                                    (GPT2, "fp32", 0.01, False), (GPT2, "bf16", 0.2, False),
                                                    (GPT2, "fp32", 0.01, True), (GPT2, "bf16", 0.2, True)],
                         ids=["llama-fp32", "llama-bf16", "gpt2-fp32", "gpt2-bf16", "gpt2-fp32-sunk",
                              "gpt2-bf16-sunk"])
def test_backward_adds_what_the_count_says(cfg, precision, tol, sunk):
    """Profiler memory events over one block's forward and backward (weight gradients preallocated,
    as the engine takes them as they come): the backward's peak above what was live when it began,
    against ``backward``, within ``tol`` of the layer's saved bytes. fp32: exact (SwiGLU's two f-wide
    gradients; GeLU's one and its up projection's weight gradient, which ZeRO-3's gradient sink forms
    in its buffer instead: ``sunk``). bf16 at this small width holds a 16-bit weight gradient more while
    the next node runs (measured +2.3 and +5 s b h bytes here, 0 at h = 256: benchmarks/bench_memory.py)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from mpformer.layers.grad_store import set_grad_sink

    model, seq, x, ctx = _block(cfg, precision, "none")
    with ctx:
        model.run_layers(x, range(1), seq).sum().backward()  # warm-up
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    if sunk:
        block = model.layers[0]
        projections = [p for m in (block.attn.qkv, block.attn.o, block.mlp.up, block.mlp.down) for p in m.parameters()]
        sink = _Sink(projections)
        for p in projections:
            p.grad = None
            set_grad_sink(p, sink)
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
    lb = layer_bytes(cfg, ParallelLayout(), S, B, precision, sunk=sunk)
    assert abs(peak - at_start - lb.backward) <= tol * lb.saved, (peak - at_start, lb.backward, lb.saved)
    if sunk:
        assert all(p.grad is None for p in projections) and any(b.abs().sum() > 0 for b in sink.buffers.values())


@pytest.mark.parametrize("cfg", [LLAMA, GPT2], ids=["llama", "gpt2"])
@pytest.mark.parametrize("tp", [1, 2])
def test_layer_parameters_in_model_order(cfg, tp):
    from mpformer.models.transformer import Transformer

    sizes = layer_param_sizes(cfg, tp)
    assert sum(sizes) == layer_params_per_rank(cfg, tp)
    if tp == 1:
        assert sizes == [p.numel() for p in Transformer(cfg, seed=None, device="meta").layers[0].parameters()]


@pytest.mark.parametrize("cfg", [LLAMA, GPT2], ids=["llama", "gpt2"])
def test_layer_parts_are_the_blocks(cfg):
    """memory.py's parts of a layer (how mpformer's ZeRO-3 makes units) are Block.parts(), parameter by parameter."""
    from mpformer.models.transformer import Transformer

    block = Transformer(cfg, seed=None, device="meta").layers[0]
    want = [[p.numel() for m in mods for p in m.parameters()] for _, mods in block.parts()]
    assert layer_part_sizes(cfg, 1) == want


def test_buckets_are_the_engines():
    """The walk's buckets (elements, in launch order) are core/buffers.py's for the same parameters."""
    from mpformer.models.transformer import Transformer

    model = Transformer(LLAMA, seed=None, device="meta")
    params = [p.numel() for p in model.parameters()]
    embed, head = params[0], params[-2:]
    units = [Unit("head", head, 0.0)] + [Unit("layer", layer_param_sizes(LLAMA, 1), 0.0)] * 2 + \
        [Unit("embedding", [embed], 0.0)]
    for cap in (10_000, 50_000, 10**9):
        red = ReductionSpec(2, 2, 4, 4, cap, 2, False)
        assert [b.elems for b in buckets(units, red)] == [lay.used for lay in plan_buckets(params, 1, cap)]


def test_the_walks_pool_lends_as_the_engines():
    """step_memory's pool against the engine's GradPool (optim/bucket.py) on a random sequence of
    takes and gives: the same buffer sizes lent and the same bytes left idle (4096 fp32 elements are
    16 kB: above stage 3's byte limit here, never kept)."""
    from mpformer.autoconfig.step_memory import _Pool
    from mpformer.optim.bucket import GradPool

    for limit, limit_bytes in [(2, float("inf")), (None, 12_000.0)]:  # stage 2's count, stage 3's bytes
        _lend_and_give(GradPool(limit, limit_bytes), _Pool(limit, limit_bytes))


def _lend_and_give(real, model) -> None:
    import random

    rng = random.Random(0)
    lent: list[tuple[torch.Tensor, float]] = []
    for _ in range(300):
        if lent and rng.random() < 0.5:
            t, size = lent.pop(rng.randrange(len(lent)))
            real.give(t)
            model.give(size)
        else:
            n = rng.choice([64, 256, 1000, 4096])
            t = real.take(n, torch.device("cpu"))
            size = model.take(n * 4)
            assert (t if t._base is None else t._base).numel() * 4 == size
            lent.append((t, size))
        assert real.bytes() == sum(model.idle)
