"""Token-level pipelining (TeraPipe; context_parallel/token_slices.py, pipeline/schedules.py).

The oracle for the model is the unsliced model itself: a micro-batch run as k slices in order, each
attending to the kept keys and values of the slices before it, and its backward run last slice first
from the output gradient plus the key/value gradients the later slices left, gives the whole
sequence's loss and gradients (fp32, 1e-5 relative: the slices sum the same terms in another order).
The schedules are checked against the verifier and the closed form of the bubble.
"""

from __future__ import annotations

import copy

import pytest
import torch

from mpformer.context_parallel.token_slices import KVSlices
from mpformer.core.errors import ConfigError
from mpformer.core.layout import ParallelLayout, validate
from mpformer.core.model_config import ModelConfig
from mpformer.core.model_options import ModelOptions
from mpformer.models import Transformer
from mpformer.pipeline.actions import Schedule, ScheduleError
from mpformer.pipeline.schedules import build_schedule
from mpformer.pipeline.simulate import Costs, simulate
from mpformer.pipeline.verify import verify
from mpformer.testing.models import TINY

RTOL = 1e-5
CFGS = TINY


def _sliced_grads(name: str, k: int, *, recompute: str = "none", eos: int | None = None, fused: bool = True):
    torch.manual_seed(0)
    model = Transformer(CFGS[name], ModelOptions(recompute=recompute, document_eos=eos,
                                                       fused_cross_entropy=fused)).train()
    ref = copy.deepcopy(model)
    tokens, labels = torch.randint(1, 101, (2, 24)), torch.randint(0, 101, (2, 24))
    labels[0, 3] = -100
    if eos is not None:
        tokens[:, 7], tokens[1, 15] = eos, eos
    want = ref(tokens, labels)
    want.backward()
    past, outs = KVSlices(k), []
    for s in range(k):
        past.current = s
        seq = model.sequence(tokens, past, s)
        x = model.run_layers(model.embed_tokens(tokens, seq), range(len(model.layers)), seq)
        outs.append(model.head_output(x, labels, seq))
    for s in reversed(range(k)):  # the schedule's order: a slice's backward after every later slice's
        past.current = s
        roots, grads = past.roots()
        torch.autograd.backward([outs[s], *roots], [None, *grads])
        past.release()
    assert len(past) == 0, "every slice's keys and values released after its backward"
    got = torch.stack(outs).sum().detach()
    return got, want.detach(), [(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters())]


@pytest.mark.parametrize("name,k,kw", [("llama", 2, {}), ("llama", 3, {}), ("llama", 4, {}), ("gpt2", 3, {}),
                                       ("gpt2", 2, {"fused": False}), ("mistral", 4, {}),
                                       ("llama", 3, {"recompute": "full"}), ("llama", 3, {"recompute": "selective"}),
                                       ("llama", 4, {"eos": 5})])
def test_slices_give_the_whole_sequence_loss_and_gradients(name, k, kw):
    got, want, grads = _sliced_grads(name, k, **kw)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=0)
    for mine, ref in grads:
        torch.testing.assert_close(mine, ref, rtol=RTOL, atol=RTOL * ref.abs().max().item())


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_every_sliced_schedule_verifies_and_its_bubble_falls_as_the_closed_form(name):
    for pp in (2, 3, 4, 8, 16):
        for m in (1, 2, 5, 16, 64):
            for k in (2, 3, 4, 8):
                if pp * m * k > 4096:  # the largest grids take seconds each; pp=16, m=64 runs at k=2, 3, 4
                    continue
                s = build_schedule(name, pp, m, slices=k)
                assert s.microbatches == m * k and s.slices == k
                peaks = verify(s).peak_inflight
                if name == "1f1b":  # k-1 more warmup forwards than 1F1B: p-1+k slices on rank 0
                    assert peaks == [min(m * k, pp - r - 1 + k) for r in range(pp)], (pp, m, k)
    bubbles = []
    for k in (1, 2, 4, 8):  # unit costs split evenly over the slices: (p-1) / (m k + p - 1)
        r = simulate(build_schedule(name, 4, 4, slices=k), Costs(f=1 / k, b=1 / k, w=1 / k))
        assert r.bubble_fraction == pytest.approx(3 / (4 * k + 3), abs=1e-9), k
        bubbles.append(r.bubble_fraction)
    assert bubbles == sorted(bubbles, reverse=True)


def test_the_text_form_keeps_the_slices_and_the_verifier_holds_their_order():
    s = build_schedule("1f1b", 2, 2, slices=2)
    text = s.to_text()
    assert "slices=2" in text.splitlines()[0]
    back = Schedule.from_text(text)
    assert back.slices == 2 and back.actions == s.actions
    # Slice 1's backward comes before slice 0's; swapping them must fail naming what is missing.
    bad = text.replace("rB1 B1 F3 rB0 sF3 B0", "rB0 B0 F3 rB1 sF3 B1").replace("B1 sB1 F2 B0 sB0", "B0 sB0 F2 B1 sB1")
    with pytest.raises(ScheduleError, match="next slice adds to this slice's key and value gradients"):
        verify(Schedule.from_text(bad))
    fwd = "# mpformer-schedule name=x pp=2 vpp=1 microbatches=2 slices=2\nr0: F1 sF1 F0 sF0 B0 B1\nr1: x"
    with pytest.raises(ScheduleError, match="previous slice's keys and values"):
        verify(Schedule.from_text(fwd.replace("r1: x", "r1: rF1 rF0 F1 F0 B0 sB0 B1 sB1")))
    with pytest.raises(ScheduleError, match="slices=3 must be >= 1 and divide the 4 units"):
        Schedule.from_text(text.replace("slices=2", "slices=3"))


def test_bad_token_slices_fail_with_the_valid_values():
    llama = ModelConfig(arch="llama", num_layers=4, hidden_size=64, num_attention_heads=4, num_kv_heads=2,
                        ffn_hidden_size=96, vocab_size=101)
    cases = [
        (ParallelLayout(pp=2, pp_token_slices=5), 32, "does not divide train.seq_length=32 into equal slices; "
                                                     "valid pp_token_slices: 1, 2, 4, 8, 16, 32"),
        (ParallelLayout(pp=2, tp=2, sequence_parallel=True, pp_token_slices=32), 32,
         "valid pp_token_slices: 1, 2, 4, 8, 16"),
        (ParallelLayout(pp=2, schedule="zb-h1", pp_token_slices=2), 32, "valid: parallel.schedule=gpipe or 1f1b"),
        (ParallelLayout(pp=1, pp_token_slices=2), 32, "needs parallel.pp > 1"),
        (ParallelLayout(pp=2, cp=2, pp_token_slices=2), 32, "valid: cp=1, or pp_token_slices=1"),
        (ParallelLayout(pp=2, pp_token_slices=0), 32, "parallel.pp_token_slices=0 must be an integer >= 1"),
    ]
    for layout, seq, msg in cases:
        with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace(")", r"\)")) as e:
            validate(layout, llama, layout.tp * layout.pp * layout.cp, seq_length=seq)
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="schedule interleaved cannot run token slices"):
        build_schedule("interleaved", 2, 4, 2, slices=2)
    validate(ParallelLayout(pp=2, pp_token_slices=4), llama, 2, seq_length=32)  # a valid one passes


def test_the_models_price_slices_as_the_schedule_runs_them():
    """The cost model's pipeline term runs the sliced schedule (its extension past 2p micro-batches
    equals the whole timeline), its bubble falls with k, the attention of the later slices is priced,
    and the memory model's in-flight count is the verifier's."""
    from mpformer.autoconfig.cluster import load_cluster
    from mpformer.autoconfig.cost import iteration_time, stage_costs
    from mpformer.autoconfig.inflight import inflight_closed_form
    from mpformer.autoconfig.memory import Workload, plan_memory
    from mpformer.autoconfig.pipeline_cost import pipeline_time

    for name in ("gpipe", "1f1b"):
        for p, m, k in ((2, 3, 2), (4, 8, 4), (4, 5, 3), (8, 2, 8)):
            assert inflight_closed_form(name, p, m, 1, k) == tuple(verify(build_schedule(name, p, m, slices=k))
                                                                   .peak_inflight), (name, p, m, k)
    costs = Costs(f=[0.3, 0.25, 0.25, 0.4], b=[0.6, 0.5, 0.5, 0.8], w=[0.0] * 4, p2p=0.02)
    for k in (2, 4):
        for m in (9, 13):
            full = simulate(build_schedule("1f1b", 4, m, slices=k), costs).step_time
            assert pipeline_time("1f1b", 4, m, 1, costs, slices=k) == pytest.approx(full, rel=1e-9), (k, m)

    gpt = ModelConfig(arch="llama", num_layers=16, hidden_size=4096, num_attention_heads=32, num_kv_heads=8,
                      ffn_hidden_size=14336, vocab_size=32000)
    w = Workload(global_batch_size=8, micro_batch_size=1, seq_length=8192, precision="bf16")
    c = load_cluster("dgx-h100")
    n = gpt.num_params() // 4
    bubbles, steps = [], []
    for k in (1, 2, 4, 8):
        L = ParallelLayout(dp=1, pp=4, pp_token_slices=k)
        b = iteration_time(gpt, L, w, c, params_per_rank=n)
        bubbles.append(b.pp_bubble_s / b.iteration_s)
        steps.append(b.iteration_s)
        assert b.extra["microbatches"] == 8
    assert bubbles == sorted(bubbles, reverse=True) and bubbles[-1] < bubbles[0] / 3, bubbles
    # A slice's attention reaches over the earlier slices: k slices' forwards cost more than one
    # micro-batch's (k times the attention of an s/k sequence, plus shorter GEMMs), never less.
    whole, sliced = (sum(stage_costs(gpt, ParallelLayout(dp=1, pp=4, pp_token_slices=k), w, c)[0]) for k in (1, 4))
    assert whole < 4 * sliced < 1.1 * whole
    # Memory: 1F1B's rank 0 keeps p - 1 + k slices of keys and activations, not p micro-batches.
    mem = [plan_memory(gpt, ParallelLayout(dp=1, pp=4, pp_token_slices=k), w)[0].activations for k in (1, 4)]
    assert mem[1] < mem[0] * (3 + 4) / 4 / 4 * 1.6, mem  # 7 quarter micro-batches, and their kept keys
