"""train.precision=fp8 at parallel layouts, through the real entry point (issue 35).

Oracle: the one-process fp8 run of the same recipe (same global batch, same initialisation). At tp=2 with
sequence parallelism, cp=2, pp=2 under 1F1B and ZB-V (the zero-bubble store defers the float8
weight-gradient GEMMs) and dp=2 under ZeRO-1 and 2 (each rank casts its own micro-batch, as one process
casts each of its micro-batches; delayed scaling's histories meet once a step), 10 steps of losses
track it within 2e-2 relative: the tolerance the suite uses for bf16 layouts (the float8 operands
themselves are equal bit for bit, tests/distributed/test_fp8_operands.py; what differs is the order of
the sums over the shards, whose bf16 roundings then move the next cast's inputs; under a pipeline, the
loss's and the gradients' sums). Delayed scaling's
state travels with checkpoints: stopped at step 5 at tp=2 and resumed at tp=2 it continues bit for bit;
resumed at pp=2 it continues within the tolerance (a checkpoint loads at any layout).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mpformer.parallel.spawn import run_distributed
from mpformer.testing.train import overrides, train

STEPS = 10
BASE = {"model": "tiny-llama", "model.ffn_hidden_size": 128, "model.num_layers": 4, "train.seq_length": 32,
        "train.steps": STEPS, "train.global_batch_size": 4, "train.micro_batch_size": 2, "train.device": "cpu",
        "optim.lr": 3e-3, "optim.warmup_steps": 1, "logging.progress": False, "train.precision": "fp8"}
TOLERANCE = 2e-2  # relative, per step: the suite's bf16 layout tolerance
TP2 = {"parallel.tp": 2, "parallel.sequence_parallel": True}
RUNS = {  # name -> (world, recipe, overrides); runs of a world in order (a resume follows its stop)
    "ref_tensorwise": (1, "tensorwise", {}),
    "ref_rowwise": (1, "rowwise", {}),
    "ref_delayed": (1, "delayed", {}),
    "tp2sp_tensorwise": (2, "tensorwise", TP2),
    "tp2sp_rowwise": (2, "rowwise", TP2),
    "tp2sp_delayed": (2, "delayed", TP2),
    "cp2_rowwise": (2, "rowwise", {"parallel.cp": 2}),
    "cp2_delayed": (2, "delayed", {"parallel.cp": 2}),
    "pp2_1f1b_tensorwise": (2, "tensorwise", {"parallel.pp": 2, "parallel.schedule": "1f1b"}),
    "pp2_zbv_delayed": (2, "delayed", {"parallel.pp": 2, "parallel.schedule": "zb-v", "parallel.vpp": 2}),
    "dp2_zero2_tensorwise": (2, "tensorwise", {"parallel.dp": 2, "parallel.zero": 2}),
    "dp2_zero1_delayed": (2, "delayed", {"parallel.dp": 2, "parallel.zero": 1}),
    "tp2sp_delayed_stop5": (2, "delayed", {**TP2, "train.stop_at": 5}),
    "tp2sp_delayed_resumed": (2, "delayed", {**TP2, "checkpoint.load": "{root}/tp2sp_delayed_stop5/checkpoints"}),
    "pp2_delayed_resumed": (2, "delayed", {"parallel.pp": 2, "parallel.schedule": "1f1b",
                                           "checkpoint.load": "{root}/tp2sp_delayed_stop5/checkpoints"}),
}
LAYOUTS = [n for n, (w, _, kw) in RUNS.items() if w == 2 and "train.stop_at" not in kw and "checkpoint.load" not in kw]


def _worker(world: int, data: str, root: str) -> dict:
    out = {}
    for name, (w, recipe, kw) in RUNS.items():
        if w == world:
            kw = {k: (v.format(root=root) if isinstance(v, str) else v) for k, v in kw.items()}
            run = overrides({**BASE, "data.paths": f"[{data}]"}, Path(root) / name, **kw,
                            **{"train.fp8.recipe": recipe})
            out[name] = train(run)["losses"]
    return out


@pytest.fixture(scope="module")
def results(tiny_data, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("fp8_layouts"))
    res = {}
    for world in (1, 2):
        res.update(run_distributed(_worker, world, args=(world, tiny_data, root), timeout=600)[0])
    return res


@pytest.mark.parametrize("run", LAYOUTS)
def test_fp8_layout_tracks_one_process(results, run):
    got, want = results[run], results[f"ref_{RUNS[run][1]}"]
    assert len(got) == len(want) == STEPS
    for g, w in zip(got, want):
        assert abs(g - w) <= TOLERANCE * abs(w), (run, got, want)
    assert got != results[f"ref_{'rowwise' if RUNS[run][1] != 'rowwise' else 'tensorwise'}"], "not its recipe"


def test_fp8_resume_exact_and_across_layouts(results):
    full, resumed = results["tp2sp_delayed"], results["tp2sp_delayed_resumed"]
    assert results["tp2sp_delayed_stop5"] == full[:5]
    assert resumed == full[5:], (resumed, full)
    torch.testing.assert_close(torch.tensor(results["pp2_delayed_resumed"]), torch.tensor(full[5:]),
                               rtol=TOLERANCE, atol=0)
