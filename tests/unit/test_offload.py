"""Activation offload (pipeline/offload.py): which units move, that the moved activations come back to
the same bits (the backward equals the one without offload, torch.equal), the layout's errors, and
how the memory and cost models price it."""

from __future__ import annotations

import copy

import pytest
import torch

from mpformer.core.errors import ConfigError
from mpformer.core.layout import ParallelLayout, validate
from mpformer.core.model_config import ModelConfig
from mpformer.core.model_options import ModelOptions
from mpformer.models import Transformer
from mpformer.parallel.device import Device, HostCopies
from mpformer.pipeline.actions import Op
from mpformer.pipeline.offload import ActivationOffload, offload_units, prefetch_points
from mpformer.pipeline.schedules import build_schedule

LLAMA = ModelConfig(arch="llama", num_layers=4, hidden_size=64, num_attention_heads=4, num_kv_heads=2,
                    ffn_hidden_size=96, vocab_size=101)


def test_which_units_move_and_when_they_come_back():
    s = build_schedule("1f1b", 4, 8)
    every = {(i, 0) for i in range(8)}
    assert offload_units(s.actions[0], "all") == every
    assert offload_units(s.actions[3], "all") == set()  # the last stage: each backward follows its forward
    assert offload_units(s.actions[0], "none") == set()
    # auto keeps one unit in flight: rank 0 of 1F1B keeps micro-batches 0 and 4 (each opens a window)
    assert offload_units(s.actions[0], "auto", 1) == every - {(0, 0), (4, 0)}
    assert offload_units(s.actions[0], "auto", 4) == set()  # 1F1B's rank 0 never holds more than p = 4
    computes = [a for a in s.actions[0] if not a.op.is_comm]
    points = prefetch_points(s.actions[0], every)
    assert sorted(points.values()) == sorted(every)
    for i, key in points.items():  # each comes back during the compute just before its backward
        nxt = next(a for a in s.actions[0][i + 1:] if not a.op.is_comm)
        assert nxt.op is Op.B and (nxt.microbatch, nxt.chunk) == key
    assert computes[0].op is Op.F
    # zero-bubble schedules: the input-gradient pass is the unit's backward
    zb = build_schedule("zb-h2", 4, 8)
    moved = offload_units(zb.actions[1], "all")
    for i, key in prefetch_points(zb.actions[1], moved).items():
        nxt = next(a for a in zb.actions[1][i + 1:] if not a.op.is_comm)
        assert nxt.op is Op.BI and (nxt.microbatch, nxt.chunk) == key


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_moved_activations_come_back_bit_for_bit(recompute):
    torch.manual_seed(0)
    model = Transformer(LLAMA, ModelOptions(recompute=recompute)).train()
    ref = copy.deepcopy(model)
    tokens, labels = torch.randint(0, 101, (2, 16)), torch.randint(0, 101, (2, 16))
    ref(tokens, labels).backward()
    off = ActivationOffload(HostCopies(Device("cpu")), model, {(0, 0)})
    off.start()
    with off.saving((0, 0)):
        loss = model(tokens, labels)
    assert off.moved_bytes > 0 and len(off._saved[(0, 0)]) > 0
    off.prefetch((0, 0))
    loss.backward()
    off.done((0, 0))
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)
    # Parameters stay where they are: nothing of a parameter's storage is among the moved bytes.
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert off.moved_bytes < 50 * params


def test_bad_offload_fails_with_the_valid_values():
    with pytest.raises(ConfigError, match=r"at pp=1 none waits .*valid at pp=1: offload=none"):
        validate(ParallelLayout(offload="all"), LLAMA, 1, seq_length=16)
    with pytest.raises(ConfigError, match=r"parallel.offload='sometimes' is unknown; valid: none, auto, all"):
        validate(ParallelLayout(pp=2, offload="sometimes"), LLAMA, 2, seq_length=16)
    with pytest.raises(ConfigError, match=r"offload_keep=2 is the budget of offload=auto.*valid: offload=auto"):
        validate(ParallelLayout(pp=2, offload="all", offload_keep=2), LLAMA, 2, seq_length=16)
    with pytest.raises(ConfigError, match=r"parallel\.offload_keep=0 must be an integer >= 1"):
        validate(ParallelLayout(pp=2, offload="auto", offload_keep=0), LLAMA, 2, seq_length=16)
    validate(ParallelLayout(pp=2, offload="auto", offload_keep=2), LLAMA, 2, seq_length=16)


def test_the_models_price_offload():
    """Memory: 1F1B's rank 0 at p=4 keeps two layers of the micro-batch it runs (one back-propagated, one
    read ahead) and the last layer of one being copied out: under one micro-batch of its 4 layers
    (tests/unit/test_offload_memory.py measures the engine's), under a quarter of one with 16 layers a
    rank, and the received inputs; the host takes the rest; nothing moves on a CPU host; under
    full recompute the layers' kept inputs move. Cost: a copy out longer than the forward it hides
    behind adds its excess to the forward, a copy back longer than the backward to the backward."""
    from dataclasses import replace

    from mpformer.autoconfig.cluster import load_cluster
    from mpformer.autoconfig.cost import iteration_time
    from mpformer.autoconfig.memory import Workload, plan_memory

    m = ModelConfig(arch="llama", num_layers=16, hidden_size=4096, num_attention_heads=32, num_kv_heads=8,
                    ffn_hidden_size=14336, vocab_size=32000)
    w = Workload(global_batch_size=16, micro_batch_size=1, seq_length=4096, precision="bf16")

    def acts(**kw):
        return [s.activations for s in plan_memory(m, ParallelLayout(dp=1, pp=4, **kw), w)]

    none, every, auto = acts(), acts(offload="all"), acts(offload="auto", offload_keep=1)
    per_micro = none[0] / 4  # rank 0 of 1F1B at p=4 holds 4 micro-batches
    assert every[0] <= 1.0 * per_micro and auto[0] <= 2.0 * per_micro < none[0]
    deep = replace(m, num_layers=64)  # 16 layers a rank: still two layers and the inputs on the device
    deep_none, deep_all = (plan_memory(deep, ParallelLayout(dp=1, pp=4, offload=o), w)[0].activations
                           for o in ("none", "all"))
    assert deep_all <= 0.25 * deep_none / 4
    host = plan_memory(m, ParallelLayout(dp=1, pp=4, offload="all"), w)[0].host
    assert 3.5 * per_micro < host < 4 * per_micro  # the 4 in flight, less their inputs (they stay)
    assert every[3] == none[3]  # the last stage moves nothing
    assert [s.activations for s in plan_memory(m, ParallelLayout(dp=1, pp=4, offload="all"), w, device="cpu")] == none
    full = [s.activations for s in plan_memory(m, ParallelLayout(dp=1, pp=4, recompute="full"), w)]
    moved = [s.activations for s in plan_memory(m, ParallelLayout(dp=1, pp=4, recompute="full", offload="all"), w)]
    assert moved[0] < full[0] and moved[3] == full[3]
    c = load_cluster("dgx-h100")
    n = m.num_params() // 4
    t0 = iteration_time(m, ParallelLayout(dp=1, pp=4), w, c, params_per_rank=n).iteration_s
    t1 = iteration_time(m, ParallelLayout(dp=1, pp=4, offload="all"), w, c, params_per_rank=n).iteration_s
    fast = c.__class__(**{**c.__dict__, "host_bandwidth": 1e15})  # a link the copies always hide behind
    t2 = iteration_time(m, ParallelLayout(dp=1, pp=4, offload="all"), w, fast, params_per_rank=n).iteration_s
    assert t1 > t0 and t2 == pytest.approx(t0, rel=1e-12)
    from mpformer.autoconfig.layer_memory import layer_bytes
    from mpformer.autoconfig.pipeline_cost import offload_exposed

    L = ParallelLayout(dp=1, pp=4, offload="all")
    per_layer = layer_bytes(m, L, w.seq_length, w.micro_batch_size, w.precision).saved
    # 4 layers a stage; copies of 1.5 s: longer than a 1 s forward, shorter than a 2 s backward
    mid = c.__class__(**{**c.__dict__, "host_bandwidth": 4 * per_layer / 1.5})
    fs, bs = offload_exposed(m, L, w, mid, [4] * 4, [1.0] * 4, [2.0] * 4)
    share = 1.0  # every micro-batch of stages 0-2 moves; none of the last's (its backward follows its forward)
    assert fs[:3] == [pytest.approx(1.0 + share * 0.5)] * 3 and bs == [2.0] * 4 and fs[3] == 1.0


def test_the_search_offloads_where_it_wins_and_host_memory_allows():
    """The 1T GPT on 3,072 A100s: offloading lets recompute=none fit, the copies hide behind its
    2-layer chunks' forwards, and the plan is faster than the best one without offload. It offloads only
    beyond the largest budget that fits (offload=auto: one unit more on the device does not fit), never
    slower than offloading all of them; a node whose host memory cannot take the offloaded activations
    rules those plans out."""
    from dataclasses import replace

    from mpformer.autoconfig.cluster import load_cluster
    from mpformer.autoconfig.memory import Workload, plan_memory
    from mpformer.autoconfig.search import search

    gpt = ModelConfig(arch="gpt2", num_layers=128, hidden_size=25600, num_attention_heads=160, vocab_size=51200,
                      max_position_embeddings=2048, activation="gelu_tanh", attention_bias=True, mlp_bias=True)
    c, w = load_cluster("dgx-a100-80gb", nodes=384), Workload(3072, 1, 2048, "bf16")
    best = search(gpt, c, w).top[0]
    without = search(gpt, c, w, fixed={"offload": "none"}).top[0]
    assert best.layout.offload == "auto" and best.time.iteration_s < without.time.iteration_s
    wm, L = replace(w, micro_batch_size=best.micro_batch_size), best.layout
    assert max(s.total for s in plan_memory(gpt, L, wm)) <= c.usable_bytes
    assert max(s.total for s in plan_memory(gpt, replace(L, offload_keep=L.offload_keep + 1), wm)) > c.usable_bytes
    pins = {k: getattr(L, k) for k in ("dp", "tp", "pp", "vpp", "schedule", "recompute")}
    every = search(gpt, c, w, fixed={**pins, "offload": "all", "micro_batch_size": best.micro_batch_size}).top[0]
    assert every.layout.offload == "all" and every.time.iteration_s >= best.time.iteration_s
    host = max(s.host for s in plan_memory(gpt, best.layout, replace(w, micro_batch_size=best.micro_batch_size)))
    assert 0 < host * c.devices_per_node <= c.host_memory_gb * 1e9
    small = replace(c, host_memory_gb=host * c.devices_per_node / 1e9 / 2)
    res = search(gpt, small, w, fixed={"offload": "all", **{k: getattr(best.layout, k) for k in
                                                           ("dp", "tp", "pp", "vpp", "schedule")},
                                       "micro_batch_size": best.micro_batch_size})
    assert "out of host memory" in res.rejected


def test_the_simulator_and_tools_schedule_draw_the_copies(tmp_path, capsys):
    """Copies that fit beside their computes leave the timeline as it was; longer ones stretch them;
    the Chrome trace and the picture carry a copy lane; a schedule with nothing to move is an error."""
    import json

    from mpformer.cli.schedule import main
    from mpformer.pipeline.simulate import Costs, simulate

    s = build_schedule("1f1b", 4, 8)
    units = [offload_units(a, "all") for a in s.actions]
    plain = simulate(s, Costs())
    hidden = simulate(s, Costs(copy=1.0), offload=units)
    assert hidden.step_time == plain.step_time and len(hidden.copies) == 2 * sum(len(u) for u in units)
    assert simulate(s, Costs(copy=2.0), offload=units).step_time > plain.step_time
    for r, kind, mb, _c, start, end in hidden.copies:  # out beside the unit's forward, back beside its backward
        f = next(t for t in hidden.timeline[r] if t.action.op is Op.F and t.action.microbatch == mb)
        b = next(t for t in hidden.timeline[r] if t.action.op is Op.B and t.action.microbatch == mb)
        assert start == (f.start if kind == "out" else b.start) and end <= (f.end if kind == "out" else b.end)
    trace = tmp_path / "t.json"
    assert main(["--schedule", "1f1b", "--pp", "4", "--microbatches", "8", "--offload", "all", "--copy", "0.5",
                 "--trace", str(trace), "--plot", str(tmp_path / "t.png")]) == 0
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(e.get("tid") == 2 and e["ph"] == "X" for e in events) == len(hidden.copies)
    assert (tmp_path / "t.png").stat().st_size > 0
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["--schedule", "1f1b", "--pp", "1", "--microbatches", "4", "--offload", "all"])
    assert "no unit of this schedule waits for its backward" in capsys.readouterr().err


def test_the_cost_model_counts_the_copies_offload_makes():
    """The copies priced per stage are the engine's own choice (offload_units on the built schedule's
    lists, moved_per_stage on the generator's orders: the same units); with a host link too slow to
    hide them, offload=auto's fewer copies cost less than all's, and a larger budget less again."""
    from dataclasses import replace

    from mpformer.autoconfig.cluster import load_cluster
    from mpformer.autoconfig.cost import iteration_time
    from mpformer.autoconfig.inflight import moved_per_stage
    from mpformer.autoconfig.memory import Workload
    from mpformer.core.pipeline_plan import stage_of

    for name, p, m, vpp, k in [("1f1b", 4, 8, 1, 1), ("zb-h2", 4, 9, 1, 1), ("interleaved", 2, 6, 2, 1),
                               ("zb-v", 3, 7, 2, 1), ("dualpipev", 2, 6, 2, 1), ("1f1b", 2, 4, 1, 3)]:
        s = build_schedule(name, p, m, vpp, slices=k)
        for mode, keep in (("all", 1), ("auto", 1), ("auto", 2)):
            want = [0] * (p * vpp)
            for r in range(p):
                for _, chunk in offload_units(s.actions[r], mode, keep):
                    want[stage_of(p, r, chunk, s.v)] += 1
            assert moved_per_stage(name, p, m, vpp, k, mode, keep) == tuple(want), (name, mode, keep)
    c = replace(load_cluster("dgx-a100-80gb"), host_bandwidth=1e9)  # copies far longer than the compute
    w = Workload(16, 1, 2048, "bf16")
    llama = ModelConfig(arch="llama", num_layers=16, hidden_size=4096, num_attention_heads=32, num_kv_heads=8,
                        ffn_hidden_size=14336, vocab_size=128256, max_position_embeddings=8192)
    times = [iteration_time(llama, ParallelLayout(pp=4, dp=1, offload=off, offload_keep=keep), w, c,
                            params_per_rank=10**9).iteration_s for off, keep in (("all", 1), ("auto", 1), ("auto", 2))]
    assert times[0] > times[1] > times[2]
