"""train.on_nan=skip and rollback under a pipeline (pp=2 x dp=2, ZeRO-1), under ZeRO-3 (dp=4), with
experts over ep=2 whose selection biases move each step (DeepSeek-V3), and in fp8 with delayed scaling
(tp=2 x dp=2), whose amax histories move each step.

The single-rank behaviour and its oracle are in tests/integration/test_on_nan.py; here the same
oracle (a run that never reads the poisoned step's samples, data.skip_ranges) is checked where the
loss lives on one stage, the gradients are sharded and the weights are gathered per unit. The NaN
is injected on every rank into the output of every leaf module during the step that reads sample
POISON, so the loss and every gradient (each stage's, each shard's) are NaN, as after a real blow-up.
The ranks agree on the decision because the loss and norm are global; the losses of the guarded run
must equal the oracle's bit for bit (the same reductions in the same order over the same samples),
also with optimizer post-validation, whose speculative step on the poisoned gradients is undone, and
with the check overlapping the next step (train.overlap_validation), which then runs again.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mpformer.parallel.spawn import run_distributed
from mpformer.testing.train import overrides, train

GBS, POISON_STEP = 8, 4
POISON = (POISON_STEP - 1) * GBS
BASE = {"model": "tiny-llama", "train.seq_length": 32, "train.steps": 6, "train.global_batch_size": GBS,
        "train.micro_batch_size": 1, "train.device": "cpu", "optim.lr": 3e-3, "optim.decay": "constant",
        "data.prefetch": 0, "logging.progress": False}
OVERLAP = {"train.post_validation": True, "train.overlap_validation": True}
LAYOUTS = {"pp2_dp2_z1": {"parallel.pp": 2, "parallel.zero": 1}, "dp4_z3": {"parallel.zero": 3},
           # experts over ep=2 with DeepSeek-V3's bias: a skipped step's bias moves are undone too
           "moe_ep2_bias": {"model.arch": "mixtral", "model.mlp_kind": "moe", "model.num_experts": 4,
                            "model.num_experts_per_tok": 2, "model.moe_ffn_hidden_size": 32,
                            "model.router_score": "sigmoid", "model.router_bias": True,
                            "model.router_bias_update_rate": 0.01, "parallel.ep": 2},
           # fp8 delayed scaling at tp=2+SP x dp=2: a skipped or rolled-back step's amax records are undone
           "fp8_delayed_tp2_dp2": {"train.precision": "fp8", "train.fp8.recipe": "delayed", "parallel.tp": 2,
                                   "parallel.sequence_parallel": True, "model.ffn_hidden_size": 128}}


def _poison_leaf_outputs() -> None:
    """Patch the trainer: the step reading sample POISON multiplies every leaf module's output by NaN."""
    import torch

    from mpformer.training.step import Stepper

    original = Stepper.forward_backward

    def forward_backward(self, batches):
        if self.progress.consumed_samples != POISON:
            return original(self, batches)
        hooks = [m.register_forward_hook(lambda _m, _i, out: out * float("nan")
                                         if isinstance(out, torch.Tensor) and out.is_floating_point() else out)
                 for m in self.model.modules() if not list(m.children())]
        try:
            return original(self, batches)
        finally:
            for h in hooks:
                h.remove()

    Stepper.forward_backward = forward_backward


def _worker(data: str, root: str) -> dict:
    _poison_leaf_outputs()
    out = {}
    for name, layout in LAYOUTS.items():
        base = {**BASE, **layout, "data.paths": f"[{data}]"}
        d = Path(root) / name
        out[name] = {
            "oracle": train(overrides(base, d / "oracle", **{"train.steps": BASE["train.steps"] - 1,
                                                             "data.skip_ranges": f"[[{POISON},{POISON + GBS}]]"})),
            "skip": train(overrides(base, d / "skip", **{"train.on_nan": "skip"})),
            # post-validation: the poisoned step was taken speculatively and must be undone exactly
            "skip_pv": train(overrides(base, d / "skip_pv", **{"train.on_nan": "skip", "train.post_validation": True})),
            "rollback": train(overrides(base, d / "rollback", **{"train.on_nan": "rollback",
                                                                 "checkpoint.save_interval": 2})),
            # overlapped: step 5 ran on the poisoned speculation before its check came back, and runs again
            "skip_ov": train(overrides(base, d / "skip_ov", **{"train.on_nan": "skip", **OVERLAP})),
            "rollback_ov": train(overrides(base, d / "rollback_ov", **{"train.on_nan": "rollback",
                                                                       "checkpoint.save_interval": 2, **OVERLAP})),
        }
    return out


@pytest.fixture(scope="module")
def ranks(tiny_data, tmp_path_factory) -> list[dict]:
    return run_distributed(_worker, 4, args=(tiny_data, str(tmp_path_factory.mktemp("nan"))), timeout=300)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_skip_and_rollback_equal_a_run_without_the_samples(ranks, layout):
    got = next(r[layout] for r in ranks if r[layout]["skip"]["steps"])  # the rank that writes metrics.jsonl
    oracle, skip, back = got["oracle"]["losses"], got["skip"]["losses"], got["rollback"]["losses"]
    assert all(r[layout]["skip"]["losses"][:POISON_STEP - 1] == skip[:POISON_STEP - 1] for r in ranks)
    k = POISON_STEP - 1
    assert skip[:k] == oracle[:k] and skip[k + 1:] == oracle[k:], (skip, oracle)
    assert skip[k] != skip[k]  # the poisoned step's loss is NaN, and it is skipped
    pv = got["skip_pv"]["losses"]  # the same with optimizer post-validation (its speculation undone)
    assert pv[:k] == skip[:k] and pv[k + 1:] == skip[k + 1:] and pv[k] != pv[k], (pv, skip)
    ov = got["skip_ov"]["losses"]  # and with the check overlapping the next step (training/overlap.py)
    assert ov[:k] == skip[:k] and ov[k + 1:] == skip[k + 1:] and ov[k] != ov[k], (ov, skip)
    assert got["rollback_ov"]["steps"] == got["rollback"]["steps"]
    assert got["rollback_ov"]["losses"] == back, (got["rollback_ov"]["losses"], back)
    # Rollback: steps 1-3, the poisoned step 4 is undone back to step 2's checkpoint, then 3.. on.
    assert got["rollback"]["steps"] == [1, 2, 3, 3, 4, 5, 6], got["rollback"]["steps"]
    assert back[:k] == oracle[:k] and back[k:k + 3] == oracle[k - 1:], (back, oracle)
