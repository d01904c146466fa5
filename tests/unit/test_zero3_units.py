"""ZeRO-3's units in one process (a data-parallel group of one: gathers copy the shard, reductions copy
the buffer), against plain autograd and against the memory model's account of them.

A unit's storage is resized to nothing while it is not gathered, so a forward or backward that read a
parameter of a unit not gathered would fail (or give garbage gradients): gradients equal to autograd's
(fp32, two micro-batches; 1e-6 relative, the order of the micro-batches' sum) show every read found its
unit gathered, under each recompute mode, with whole-layer units and with a unit per part, for Llama
(RMSNorm, SwiGLU, GQA) and GPT-2 (a tied head, biases, dropout: recomputed forwards that begin in a
dropout's backward). Also: at most the units of two regions gathered at any time, a prefetch only of
units within the budget, the reductions in flight within theirs, the projections' weight gradients
formed in the unit's buffer (never in ``.grad``), and the memory model's gathered elements
(runtimes.py ``parts_gathered``) equal to the largest the engine had gathered at each unit's backward.
"""

from __future__ import annotations

import pytest
import torch

from mpformer.autoconfig.memory import layer_part_sizes
from mpformer.autoconfig.runtimes import parts_gathered
from mpformer.core.model_config import ModelConfig
from mpformer.core.model_options import ModelOptions
from mpformer.models import Transformer
from mpformer.optim.engine import GradEngine, Reduction
from mpformer.optim.units import Zero3Settings
from mpformer.parallel.comm import Comm, CommLedger

CONFIGS = {
    "llama": ModelConfig(arch="llama", num_layers=3, hidden_size=32, num_attention_heads=4, num_kv_heads=2,
                         ffn_hidden_size=64, vocab_size=64),
    "gpt2-tied": ModelConfig(arch="gpt2", num_layers=3, hidden_size=32, num_attention_heads=4, activation="gelu_tanh",
                             vocab_size=64, max_position_embeddings=16, tie_embeddings=True, attention_bias=True,
                             mlp_bias=True, hidden_dropout=0.1),
}
WHOLE, SPLIT = 10**9, 0  # unit_numel: this model's layers are one unit each, or a unit per part


class Watch:
    """After every gather: the units live; at every buffer taken: the reductions in flight and the new one."""

    def __init__(self, engine: GradEngine) -> None:
        self.engine, self.live, self.takes = engine, [], []
        gather, take = engine.gather.gather, engine.grad_buffer

        def gathered(k: int, async_op: bool = False) -> None:
            gather(k, async_op)
            self.live.append(tuple(engine.gather.live()))

        def buffer(p: torch.nn.Parameter) -> torch.Tensor:
            b = engine.buckets[engine._where[id(p)][0]]
            fresh = b.grad_buf is None
            out = take(p)
            if fresh:
                self.takes.append((sum(x.layout.used for x in engine._in_flight), b.layout.used))
            return out

        engine.gather.gather, engine.grad_buffer = gathered, buffer


def _engine(cfg: ModelConfig, recompute: str, unit: int, prefetch: float = 10**9, reduce: float = 10**9):
    model = Transformer(cfg, ModelOptions(recompute=recompute), seed=1)
    engine = GradEngine(model, Reduction(Comm(None, CommLedger(), "dp.")), stage=3,
                        groups=[{"params": list(model.parameters())}], zero3=Zero3Settings(unit, prefetch, reduce),
                        make_optimizer=lambda g: torch.optim.SGD(g, lr=0.0))
    return model, engine


def _tokens() -> torch.Tensor:
    return torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("unit,prefetch,reduce", [(WHOLE, 10**9, 10**9), (SPLIT, 10**9, 10**9), (SPLIT, 2000, 0)],
                         ids=["whole", "split", "split-small-budgets"])
def test_gradients_are_autograds(name, recompute, unit, prefetch, reduce):
    cfg, tokens = CONFIGS[name], _tokens()
    ref = Transformer(cfg, ModelOptions(recompute=recompute), seed=1)
    for mb in range(2):
        torch.manual_seed(mb)
        ref(tokens[:, :-1], tokens[:, 1:]).backward()
    want = {n: p.grad for n, p in ref.named_parameters()}
    model, engine = _engine(cfg, recompute, unit, prefetch, reduce)
    watch = Watch(engine)
    for mb in range(2):
        torch.manual_seed(mb)
        model(tokens[:, :-1], tokens[:, 1:]).backward()
    engine.finish()
    assert len(engine.buckets) == 2 + cfg.num_layers * (1 if unit == WHOLE else 4)
    for n, p in model.named_parameters():
        got = torch.cat([s.master.grad for s in sorted((s for s in engine.shards if s.name == n),
                                                       key=lambda s: s.piece.lo)])
        torch.testing.assert_close(got, want[n].reshape(-1), rtol=1e-6, atol=1e-7)
        assert p.grad is None
    regions = [set(r.units) for r in engine.gather.regions]
    assert all(any(set(live) <= a | b for a in regions for b in regions) for live in watch.live)
    used = [b.layout.used for b in engine.buckets]
    for live in watch.live:  # a region's units in use, the rest prefetched within the budget
        assert any(sum(used[k] for k in set(live) - a) <= prefetch for a in regions)
    assert all(flying + new <= reduce or flying == 0 for flying, new in watch.takes)


def test_projections_form_their_weight_gradients_in_the_units_buffer():
    """Each projection's weight (and bias) reaches the engine through the sink, once per micro-batch, and
    autograd never holds a gradient for it; norms and the embedding and head go through autograd."""
    from mpformer.layers import linear

    model, engine = _engine(CONFIGS["gpt2-tied"], "none", SPLIT)
    sunk = {id(p) for p in engine._sunk}
    projections = [m for layer in model.layers for m in (layer.attn.qkv, layer.attn.o, layer.mlp.up, layer.mlp.down)]
    assert sunk == {id(p) for m in projections for p in m.parameters()}
    calls = []
    into = linear._into_sink
    linear._into_sink = lambda sink, w, *a: (calls.append(id(w)), into(sink, w, *a))
    try:
        model(_tokens()[:, :-1], _tokens()[:, 1:]).backward()
    finally:
        linear._into_sink = into
    assert sorted(calls) == sorted(id(m.weight) for m in projections)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("unit,prefetch", [(WHOLE, 10**9), (SPLIT, 10**9), (SPLIT, 3000), (SPLIT, 0)])
def test_the_models_gathered_elements_are_the_engines(name, recompute, unit, prefetch):
    """parts_gathered (the memory model) against the engine: at each unit's backward, the most elements
    gathered at once while it (or, for a recomputed layer's first unit in backward, its recomputed
    forward) ran. The walk's units come from layer_part_sizes and the same grouping rule."""
    cfg = CONFIGS[name]
    model, engine = _engine(cfg, recompute, unit, prefetch)
    g = engine.gather
    used = [b.layout.used for b in engine.buckets]
    point = {"at": None}
    most: dict[int, int] = {}
    gather = g.gather

    def note() -> None:
        if point["at"] is not None:
            most[point["at"]] = max(most.get(point["at"], 0), sum(used[k] for k in g.live()))

    def gathered(k, async_op=False):
        gather(k, async_op)
        note()

    g.gather = gathered
    # the walk point: a region's backward (its hook) or, in a recomputed layer, that layer's first in backward
    before, layer_out = g._before_backward, g._layer_backward
    last_of = {r.layer: r2 for r2, r in enumerate(g.regions) if r.layer is not None}

    def back(r, grad):
        point["at"] = r
        out = before(r, grad)
        note()
        return out

    def layer_back(i, grad):
        point["at"] = last_of[i]
        return layer_out(i, grad)

    g._before_backward, g._layer_backward = back, layer_back  # the hooks look them up on the instance
    model(_tokens()[:, :-1], _tokens()[:, 1:]).backward()
    # the walk's units in backward order: head, each layer's units from its last, the embedding
    regions = list(reversed(g.regions))
    sizes = [float(sum(used[k] for k in r.units)) for r in regions]
    reads = [r.backward_reads for r in regions]
    layers = [r.layer for r in regions]
    full = [r.layer is not None and recompute == "full" for r in regions]
    want = parts_gathered(sizes, reads, layers, full, prefetch)
    got = [most.get(len(g.regions) - 1 - j, 0) for j in range(len(regions))]
    assert got == want
    if unit == SPLIT:
        assert [sum(p) for p in layer_part_sizes(cfg, 1)] == [used[k] for r in g.regions[1:5] for k in r.units]


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("unit,prefetch", [(WHOLE, 10**9), (SPLIT, 10**9), (SPLIT, 3000)])
def test_collectives_per_micro_batch(name, recompute, unit, prefetch):
    """What the cost model prices (docs/formulas.md): with U units (2 + the layers' u_i), one micro-batch
    runs U reduce-scatters and U + (U - 1) all-gathers (forward, then backward less the embedding's),
    one more in each for a tied head (its region reads the embedding's unit), and under full recompute
    u_i - 1 more per layer, one fewer when the unit before a layer's last fits the prefetch budget."""
    cfg = CONFIGS[name]
    model, engine = _engine(cfg, recompute, unit, prefetch)
    g = engine.gather
    gathers, reductions = [], []
    gather, launch = g.gather, engine._launch

    def counted(k, async_op=False):
        if not (g.gathered[k] or g.gathering[k] is not None):
            gathers.append(k)
        gather(k, async_op)

    def launched(b):
        reductions.append(b.index)
        launch(b)

    g.gather, engine._launch = counted, launched
    model(_tokens()[:, :-1], _tokens()[:, 1:]).backward()
    layer_units = [[k for r in g.regions if r.layer == i for k in r.units] for i in range(cfg.num_layers)]
    n_units, tied = len(engine.buckets), int(cfg.tie_embeddings)
    again = 0
    if recompute == "full":
        for units in layer_units:
            kept = len(units) >= 2 and engine.buckets[units[-2]].layout.used <= prefetch
            again += len(units) - 1 - kept
    assert len(reductions) == n_units == 2 + sum(len(u) for u in layer_units)
    assert len(gathers) == n_units + tied + (n_units - 1 + tied) + again
