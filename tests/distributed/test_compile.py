"""train.compile=true composed with the parallel layouts, on 2 gloo ranks: the same training as eager.

Each block's forward compiled by inductor on CPU (Transformer.compile_layers), under tp=2 with
sequence parallelism, pp=2 with 1F1B and with ZB-V (the split backward), ZeRO-3 at dp=2 (its gathered
parameters freed by storage resizes between uses) and cp=2 ring (the attention core opaque to the
compiler: one graph break around its collectives). Oracle: the same run eager, same seed and samples.
Tolerance: losses and grad norms within 1e-5 relative (inductor fuses the elementwise work and may sum
in another order); dropout off, since inductor draws its own masks, except in one tp run that only has
to train (the tp-rank RNG streams under compile: finite and falling losses).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mpformer.parallel.spawn import run_distributed
from mpformer.testing.train import overrides, train

RTOL = 1e-5
BASE = {"model": "tiny-llama", "train.seq_length": 32, "train.steps": 3, "train.global_batch_size": 8,
        "train.micro_batch_size": 2, "train.device": "cpu", "logging.progress": False, "checkpoint.enabled": False,
        "model.hidden_dropout": 0.0, "model.attention_dropout": 0.0}
LAYOUTS = {
    "tp2_sp": {"parallel.tp": 2, "parallel.sequence_parallel": True},
    "pp2_1f1b": {"parallel.pp": 2, "parallel.schedule": "1f1b"},
    "pp2_zbv": {"parallel.pp": 2, "parallel.schedule": "zb-v", "parallel.vpp": 2, "model.num_layers": 4},
    "dp2_zero3": {"parallel.dp": 2, "parallel.zero": 3},
    "cp2_ring": {"parallel.cp": 2, "parallel.cp_kind": "ring"},
}
DROPOUT = {"parallel.tp": 2, "parallel.sequence_parallel": True, "model.hidden_dropout": 0.1, "train.steps": 6,
           "optim.lr": 3e-3}


def _worker(data: str, root: str) -> dict:
    out = {}
    for name, kw in LAYOUTS.items():
        for compiled in (False, True):
            args = overrides({**BASE, "data.paths": f"[{data}]"}, Path(root) / f"{name}_{compiled}", **kw,
                             **{"train.compile": compiled})
            out[(name, compiled)] = train(args)
    out["dropout"] = train(overrides({**BASE, "data.paths": f"[{data}]"}, Path(root) / "dropout", **DROPOUT,
                                     **{"train.compile": True}))
    return out


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    return run_distributed(_worker, 2, args=(tiny_data, str(tmp_path_factory.mktemp("compile"))), timeout=900)[0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_compiled_training_equals_eager(runs, layout):
    eager, compiled = runs[(layout, False)], runs[(layout, True)]
    assert len(compiled["losses"]) == 3
    for key in ("losses", "grad_norms"):
        torch.testing.assert_close(torch.tensor(compiled[key]), torch.tensor(eager[key]), rtol=RTOL, atol=0)


def test_compiled_tp_with_dropout_trains(runs):
    losses = runs["dropout"]["losses"]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
