"""Activation recompute changes memory, never numbers: every mode against no recompute, bit for bit.

Oracle: the same run without recompute. Selective (the attention core), full (whole layers) and
full or selective on the first K layers of each pipeline chunk only (``parallel.recompute_layers``)
must give *identical* losses, gradient norms and final weights (==, no tolerance): recompute runs
the same ops on the same inputs, with dropout masks replayed from the saved generator states.
Checked with dropout on, on one process, under every pipeline schedule (the zero-bubble ones
split each backward into an input and a deferred weight part), under tp=2 with sequence
parallelism, and under context parallelism.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mpformer.parallel.spawn import run_distributed
from mpformer.testing.train import overrides, train

BASE = {"model": "tiny-llama", "model.num_layers": 4, "model.vocab_size": 256, "model.hidden_dropout": 0.1,
        "train.seq_length": 32, "train.steps": 3, "train.global_batch_size": 8, "train.micro_batch_size": 2,
        "train.device": "cpu", "optim.lr": 3e-3, "optim.warmup_steps": 1, "logging.progress": False}
MODES = {"none": {"parallel.recompute": "none"}, "selective": {"parallel.recompute": "selective"},
         "full": {"parallel.recompute": "full"},
         "full_k1": {"parallel.recompute": "full", "parallel.recompute_layers": 1},
         "selective_k1": {"parallel.recompute": "selective", "parallel.recompute_layers": 1}}
SCHEDULES = {"gpipe": {}, "1f1b": {}, "interleaved": {"parallel.vpp": 2}, "zb-h1": {}, "zb-h2": {}}
LAYOUTS = {  # name -> (world size, overrides)
    "one": (1, {"model.attention_dropout": 0.1}),
    **{f"pp2_{s}": (2, {"parallel.pp": 2, "parallel.schedule": s, **kw}) for s, kw in SCHEDULES.items()},
    "tp2_sp": (2, {"parallel.tp": 2, "parallel.sequence_parallel": True, "model.attention_dropout": 0.1}),
    "cp2": (2, {"parallel.cp": 2, "parallel.cp_kind": "ring"}),
}


def _worker(world: int, data: str, root: str) -> dict:
    from mpformer.checkpoint.io import read_all_tensors

    out = {}
    for layout, (w, kw) in LAYOUTS.items():
        if w != world:
            continue
        for mode, mkw in MODES.items():
            run_dir = Path(root) / f"{layout}_{mode}"
            got = train(overrides({**BASE, "data.paths": f"[{data}]"}, run_dir, **kw, **mkw))
            got["weights"] = read_all_tensors(run_dir / "checkpoints")  # the final step's, in full
            out[(layout, mode)] = got
    return out


@pytest.fixture(scope="module")
def results(tiny_data, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("recompute"))
    res = {}
    for world in (1, 2):
        res.update(run_distributed(_worker, world, args=(world, tiny_data, root), timeout=900)[0])
    return res


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("mode", [m for m in MODES if m != "none"])
def test_recompute_is_bit_identical_to_none(results, layout, mode):
    got, want = results[(layout, mode)], results[(layout, "none")]
    assert len(want["losses"]) == 3
    assert got["losses"] == want["losses"]
    assert got["grad_norms"] == want["grad_norms"]
    assert got["weights"].keys() == want["weights"].keys()
    for name, t in want["weights"].items():
        assert torch.equal(got["weights"][name], t), name
