"""Data parallelism on gloo ranks against single-process training (the oracle), fp32.

Tolerance: 1e-5 relative on losses, gradient norms and final weights (but for 1 weight in 10^4:
see _weights_close); the only differences allowed are the order of floating-point sums (all-reduce,
accumulation over micro-batches).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mpformer.parallel.spawn import run_distributed
from mpformer.testing.train import overrides, train

RTOL = 1e-5


BASE = {"model": "tiny-llama", "train.seq_length": 32, "train.steps": 6, "train.global_batch_size": 8,
        "train.micro_batch_size": 2, "train.device": "cpu", "optim.lr": 3e-3, "optim.warmup_steps": 2,
        "optim.clip_grad": 0.5, "logging.progress": False}


def _overrides(data: str, run_dir: Path, **kw) -> list[str]:
    return overrides({**BASE, "data.paths": f"[{data}]"}, run_dir, **kw)


def _final_weights(ckpt: Path) -> torch.Tensor:
    from mpformer.checkpoint.io import read_all_tensors

    t = read_all_tensors(ckpt)
    return torch.cat([t[k].flatten() for k in sorted(t)])


def _weights_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Final weights to 1e-5 relative (1e-7 absolute), but for at most 1 element in 10^4, which may
    differ up to 1e-4: AdamW's step is lr * m_hat / sqrt(v_hat) whatever the gradient's size, so an
    element whose gradient sums to rounding level (dp=2 adds its halves in another order) can move
    differently in the two runs (seen: 2 of 125k elements, by 5e-7). A real fault (a misplaced shard
    or bucket, a missed reduction) moves most elements of a tensor, by about the weights' scale."""
    off = ~torch.isclose(got, want, rtol=RTOL, atol=1e-7)
    assert int(off.sum()) <= got.numel() // 10_000, f"{int(off.sum())} of {got.numel()} weights differ"
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def _check_grad_buckets() -> dict:
    """The gradient engine at ZeRO stage 0 alone: mean gradients across ranks, several buckets, no
    traffic under no_sync."""
    import torch.distributed as dist

    from mpformer.core.model_config import ModelConfig

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    # A GQA Llama, and a GPT-2 whose tied embedding gets gradients from two places.
    for cfg in (ModelConfig(arch="llama", num_layers=2, hidden_size=32, num_attention_heads=4, num_kv_heads=2,
                            ffn_hidden_size=64, vocab_size=64),
                ModelConfig(arch="gpt2", num_layers=2, hidden_size=32, num_attention_heads=4, activation="gelu_tanh",
                            vocab_size=64, max_position_embeddings=16, tie_embeddings=True, attention_bias=True,
                            mlp_bias=True)):
        out[cfg.arch] = _check_one_model(cfg, rank, world)
    return out["llama"]


def _check_one_model(cfg, rank: int, world: int) -> dict:
    import torch.distributed as dist

    from mpformer.core.config import OptimConfig
    from mpformer.models import Transformer
    from mpformer.optim.builder import build_engine
    from mpformer.optim.engine import Reduction
    from mpformer.parallel.comm import Comm, CommLedger

    batches = [torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(r)) for r in range(world)]
    ref = Transformer(cfg, seed=1)
    for b in batches:  # the oracle: mean gradient over every rank's batch, in one process
        (ref(b[:, :-1], b[:, 1:]) / world).backward()
    model = Transformer(cfg, seed=1)
    ledger = CommLedger()
    # ~2.6k floats a bucket: several.
    dp = build_engine(model, Reduction(Comm(dist.group.WORLD, ledger)), 0, OptimConfig(), "cpu", bucket_mb=0.01)
    with dp.no_sync():
        model(batches[rank][:, :-1], batches[rank][:, 1:]).mul(0.5).backward()
    assert ledger.take() == {} and ledger.take_seconds() == {}, "no_sync must not communicate"
    model(batches[rank][:, :-1], batches[rank][:, 1:]).mul(0.5).backward()
    dp.finish()
    sent = ledger.take()["all_reduce"]
    blocked = ledger.take_seconds()  # the bucket waits in finish(): the reduction backward did not hide
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=1e-7, msg=name)
    dp.zero_grad()
    assert all(float(p.grad.abs().sum()) == 0 for p in model.parameters())
    return {"buckets": len(dp.buckets), "bytes": sent, "numel": sum(p.numel() for p in model.parameters()),
            "blocked": blocked}


def _kernel_agreement(data: str, root: Path) -> dict:
    """The CPU kernel choice of a bf16 run (parallel/kernel_choice.py) with ranks whose environments
    disagree: every rank takes rank 0's; a resume takes the checkpoint's unless told otherwise."""
    import os

    import torch.distributed as dist

    from mpformer.checkpoint.manifest import newest_complete
    from mpformer.parallel.kernel_choice import choose

    rank, keys = dist.get_rank(), ("MPFORMER_CPU_ATTENTION", "MPFORMER_CPU_DGRAD")
    before = {k: os.environ.get(k) for k in keys}
    os.environ["MPFORMER_CPU_ATTENTION"] = "fp32" if rank == 0 else "native"
    os.environ["MPFORMER_CPU_DGRAD"] = "transposed" if rank == 0 else "nn"
    out = {"chosen": choose("cpu", "bf16").to_dict()}
    bf16 = {"train.precision": "bf16", "train.steps": 4}
    train(_overrides(data, root / "kern_a", **bf16, **{"train.stop_at": 2}))
    for k in keys:
        del os.environ[k]
    load = {"checkpoint.load": str(root / "kern_a" / "checkpoints")}
    train(_overrides(data, root / "kern_b", **bf16, **load))
    train(_overrides(data, root / "kern_c", **bf16, **load, **{"train.cpu_attention": "native"}))
    os.environ.update({k: v for k, v in before.items() if v is not None})
    for run in ("kern_a", "kern_b", "kern_c"):
        manifest = newest_complete(root / run / "checkpoints")[0]
        out[run] = dict(manifest["kernels"])
    return out


def _worker_dp2(data: str, root: str) -> dict:
    out = {"buckets": _check_grad_buckets(), "kernels": _kernel_agreement(data, Path(root))}
    root_p = Path(root)
    out["dp2"] = train(_overrides(data, root_p / "dp2"))
    out["dp2_resumed"] = train(_overrides(data, root_p / "dp2_resumed",
                                           **{"checkpoint.load": str(root_p / "dp1_stop3" / "checkpoints")}))
    out["dp2_stop3"] = train(_overrides(data, root_p / "dp2_stop3", **{"train.stop_at": 3}))
    out["dp2_same_dp"] = train(_overrides(data, root_p / "dp2_same_dp",
                                           **{"checkpoint.load": str(root_p / "dp2_stop3" / "checkpoints")}))
    return out


def _worker_dp1(data: str, root: str) -> dict:
    root_p = Path(root)
    return {
        "big_batch": train(_overrides(data, root_p / "big", **{"train.micro_batch_size": 8})),
        "accum4": train(_overrides(data, root_p / "accum4")),
        "dp1_stop3": train(_overrides(data, root_p / "dp1_stop3", **{"train.stop_at": 3})),
        "bf16": train(_overrides(data, root_p / "bf16", **{"train.precision": "bf16", "train.stop_at": 3})),
    }


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("dp")
    one = run_distributed(_worker_dp1, 1, args=(tiny_data, str(root)), timeout=180)[0]
    two = run_distributed(_worker_dp2, 2, args=(tiny_data, str(root)), timeout=180)
    return root, one, two


def test_the_kernel_choice_is_rank_0s_and_a_resume_keeps_it(runs):
    _, _, two = runs
    ranks = [two[r]["kernels"] for r in range(2)]
    assert ranks[0]["chosen"] == ranks[1]["chosen"]  # rank 1's environment said otherwise
    assert (ranks[0]["chosen"]["attention"], ranks[0]["chosen"]["dgrad"]) == ("fp32", "transposed")
    saved, resumed, told = ranks[0]["kern_a"], ranks[0]["kern_b"], ranks[0]["kern_c"]
    assert (saved["attention"], saved["dgrad"], saved["source"]) == ("fp32", "transposed", "MPFORMER_CPU_ATTENTION, "
                                                                     "MPFORMER_CPU_DGRAD")
    assert (resumed["attention"], resumed["dgrad"], resumed["source"]) == ("fp32", "transposed", "checkpoint")
    assert (told["attention"], told["dgrad"]) == ("native", "transposed")
    assert told["source"] == "train.cpu_attention, checkpoint"


def test_dp2_equals_dp1_with_the_same_global_batch(runs):
    root, one, two = runs
    ref, dp2 = one["accum4"], two[0]["dp2"]
    assert len(dp2["losses"]) == 6
    torch.testing.assert_close(torch.tensor(dp2["losses"]), torch.tensor(ref["losses"]), rtol=RTOL, atol=0)
    torch.testing.assert_close(torch.tensor(dp2["grad_norms"]), torch.tensor(ref["grad_norms"]), rtol=RTOL, atol=0)
    assert two[0]["dp2"]["losses"] == two[1]["dp2"]["losses"], "every rank reports the global-batch loss"
    _weights_close(_final_weights(root / "dp2" / "checkpoints"), _final_weights(root / "accum4" / "checkpoints"))
    assert ref["losses"][-1] < ref["losses"][0], "the loss falls"


def test_accumulated_micro_batches_equal_one_large_batch(runs):
    _, one, _ = runs
    torch.testing.assert_close(torch.tensor(one["accum4"]["losses"]), torch.tensor(one["big_batch"]["losses"]),
                               rtol=RTOL, atol=0)
    torch.testing.assert_close(torch.tensor(one["accum4"]["grad_norms"]),
                               torch.tensor(one["big_batch"]["grad_norms"]), rtol=RTOL, atol=0)


def test_bf16_autocast_tracks_fp32(runs):
    """bf16 matmuls with fp32 weights: the first losses stay within 2e-2 relative of fp32."""
    _, one, _ = runs
    torch.testing.assert_close(torch.tensor(one["bf16"]["losses"]), torch.tensor(one["accum4"]["losses"][:3]),
                               rtol=2e-2, atol=0)
    assert one["bf16"]["losses"] != one["accum4"]["losses"][:3], "bf16 really ran in bf16"


def test_dp1_checkpoint_resumes_at_dp2_with_the_same_samples(runs):
    _, one, two = runs
    resumed = two[0]["dp2_resumed"]
    assert resumed["steps"] == [4, 5, 6]
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(one["accum4"]["losses"][3:]),
                               rtol=RTOL, atol=0)


def test_dp2_resume_at_dp2_is_bit_identical(runs):
    _, _, two = runs
    full, first, second = two[0]["dp2"], two[0]["dp2_stop3"], two[0]["dp2_same_dp"]
    assert first["losses"] + second["losses"] == full["losses"]  # exact
    assert first["grad_norms"] + second["grad_norms"] == full["grad_norms"]


def test_gradient_buckets_reduce_to_the_mean(runs):
    _, _, two = runs
    b = two[0]["buckets"]
    assert b["buckets"] > 2
    # Ring all-reduce over 2 ranks: 2 (n-1)/n = 1 times the fp32 gradient bytes, once per step.
    assert b["bytes"] == 4 * b["numel"]
    dp2 = two[0]["dp2"]
    assert all(c == dp2["comm_bytes"][0] > 0 for c in dp2["comm_bytes"])
    assert list(b["blocked"]) == ["all_reduce"] and b["blocked"]["all_reduce"] >= 0


def test_exposed_communication_is_logged_per_step(runs):
    """exposed_comm_s: host time blocked in the step's training collectives (the metrics' own
    all-reduce of the loss excluded), at most the step time."""
    _, _, two = runs
    for exposed, by_kind, step_s in two[0]["dp2"]["exposed_comm"]:
        assert 0 < exposed <= step_s
        assert exposed == pytest.approx(sum(by_kind.values()), abs=1e-5)
        assert "dp.all_reduce" in by_kind and not any(k.startswith("metrics.") for k in by_kind)
