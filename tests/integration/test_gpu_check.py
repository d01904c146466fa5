"""The prepared GPU check (benchmarks/gpu_check.sh) on this CPU: its dry run passes every part, and
without a GPU the real run fails in one line instead of passing having checked nothing."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def test_dry_run_passes_every_part(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    res = subprocess.run(["bash", str(SCRIPT), "--dry-run", str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["dry_run"] and summary["passed"]
    assert [p["name"] for p in summary["parts"]] == ["tests", "train", "fp8", "kernels", "offload", "moe"]
    assert all(p["passed"] for p in summary["parts"])
    assert all(p["result"] is not None for p in summary["parts"] if p["name"] != "tests")
    assert "passed" in (tmp_path / "tests.log").read_text()  # the kernel tests ran, not only skipped
    part = {p["name"]: p["result"] for p in summary["parts"]}
    kernels = part["kernels"]["results"]
    assert kernels["ring_rank"]["error"] < 1e-5 and kernels["documents"]["error"] < 1e-5
    moe = part["moe"]["results"]  # every shape timed grouped, padded and the loop
    assert all({"grouped", "padded", "loop"} <= set(shape["results"]["bf16"]) for shape in moe)
    assert all(shape["results"]["bf16"]["grouped"]["max_rel_err_vs_loop"] <= 2e-2 for shape in moe)
    # the fp8 row: the same run in float8 against the bf16 one (its loss within the part's tolerance)
    fp8 = part["fp8"]["result"]
    assert fp8["precision"] == "fp8" and fp8["recipe"] == "tensorwise" and abs(fp8["final_loss_gap"]) <= 0.015
    assert fp8["bf16_final_loss"] == part["train"]["result"]["loss_first_last"][1]
    # at most 8 files come back from a device run's $OUT
    assert len(list(tmp_path.iterdir())) <= 8


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: the real run would run")
def test_without_a_gpu_the_real_run_fails_in_one_line(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    res = subprocess.run(["bash", str(SCRIPT), str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "no Python here has a torch that sees a GPU" in lines[0] and "PYTHON=" in lines[0]


def test_the_wheel_set_covers_what_the_check_imports():
    """Every package gpu_check.sh may install from .whl/ is one make gpu-wheels fetches."""
    need = re.search(r"need = \{(.*?)\}", SCRIPT.read_text(), re.S).group(1)
    packages = set(re.findall(r'"[\w.]+": "([\w.-]+)"', need))
    wheels = re.search(r"^GPU_WHEELS\s*:?=(.*)$", (ROOT / "Makefile").read_text(), re.M).group(1).split()
    assert packages <= set(wheels), packages - set(wheels)


def _rehearsed_kernels_part() -> dict:
    """benchmarks/gpu_kernels.py at the size gpu_check.sh runs it, on meta tensors under the rehearsal's probe."""
    import importlib.util

    from mpformer.rehearsal.probe import FunctionProbe, Probe

    spec = importlib.util.spec_from_file_location("gpu_kernels", ROOT / "benchmarks" / "gpu_kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    probe = Probe()
    with probe, FunctionProbe(probe):
        module.main(["--device", "meta", "--reps", "1"])
    return {"peak": probe.peak, "kernels": dict(probe.kernels), "squares": probe.squares}


def _module(name: str):
    """A benchmarks/ script imported as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_part_fits_the_gpu_it_runs_on():
    """Each part rehearsed at its real size on the GPU it targets (an H100 80GB's usable memory): the
    kernels part's 16k-token layers and oracles (a dense-mask SDPA oracle once took ~96 GiB), the
    train part's 1B Llama step (gpu_check.py's run, through pretraining's build), the offload part's
    pipeline rank 0 with nothing offloaded (bench_offload.py's, through pretraining's build) and the moe
    part's four methods (bench_expert_gemm.py's)."""
    from mpformer.rehearsal.devices import gpu_target
    from mpformer.testing.rehearsal import rehearse_many

    usable = gpu_target("h100-80gb").usable_bytes
    kernels = _rehearsed_kernels_part()
    assert kernels["peak"] < usable / 4, kernels["peak"]
    assert not kernels["squares"] and "math" not in kernels["kernels"], (kernels["squares"][:2], kernels["kernels"])
    train = ["model=llama-1b", "train.precision=bf16", "train.seq_length=2048", "train.micro_batch_size=4",
             "train.global_batch_size=8", "parallel.dp=1"]  # gpu_check.py's defaults
    budget = _module("gpu_budget")
    rank, offload = rehearse_many([(train, 1, 0, None), (budget.OFFLOAD_RANK, budget.OFFLOAD["pp"], 0, None)])
    for r in (rank, offload):
        assert r["peak_bytes"] < usable, r["peak_bytes"]
        assert set(r["attention_kernels"]) == {"flash"} and not r["square_tensors"]
    # the moe part's expert GEMMs at its GPU shapes (16 GiB rehearsed: Mixtral's HF-indexing loop)
    import contextlib
    import io

    from mpformer.rehearsal.probe import FunctionProbe, Probe

    probe = Probe()
    with probe, FunctionProbe(probe), contextlib.redirect_stdout(io.StringIO()):
        _module("bench_expert_gemm").main(["--device", "meta", *budget.MOE_ARGS])
    assert probe.peak < usable / 2, probe.peak


def test_each_parts_timeout_is_the_one_its_rehearsed_work_gives():
    """gpu_check.sh's timeouts come from gpu_budget.json, and that file is what gpu_budget.py derives from
    the parts' rehearsed FLOPs and bytes now: a part made bigger without its budget fails here."""
    module = _module("gpu_budget")
    derived = {name: p["seconds"] for name, p in module.budgets()["parts"].items()}
    committed = {name: p["seconds"] for name, p in json.loads((ROOT / "benchmarks" / "gpu_budget.json").read_text())
                 ["parts"].items()}
    assert derived == committed, (derived, committed)
    # the device's 10-minute call, less its start and the wheels' install (the fp8 part took it from 392 to 472)
    assert "budget train" in SCRIPT.read_text() and "budget fp8" in SCRIPT.read_text() and sum(derived.values()) < 480
    # the moe part runs bench_expert_gemm.py with the arguments its budget counted (beside --device cuda)
    args = re.search(r"^  MOE=\(--device cuda ([^)]*)\)", SCRIPT.read_text(), re.M).group(1).split()
    assert args == module.MOE_ARGS, (args, module.MOE_ARGS)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")
def test_the_train_part_fails_without_a_gpu():
    """gpu_check.py asked for CUDA where there is none exits non-zero (it returned 0, having measured nothing)."""
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py")], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2 and "no CUDA device visible" in res.stderr


def test_the_wheel_set_names_what_other_pythons_need():
    """A GPU image on CPython 3.10 needs pytest's exceptiongroup and tomli, which this 3.11 does not install:
    the pinned set carries them with their markers (they were left out, and pytest did not import there)."""
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_wheels.py"), "pytest"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, check=True)
    marked = {line.split(";")[0].split(">")[0].split("=")[0] for line in res.stdout.splitlines() if ";" in line}
    if sys.version_info < (3, 11):
        pytest.skip("on 3.10 they are installed here and pinned")
    assert {"exceptiongroup", "tomli"} <= marked, res.stdout
