"""tools/autoconfig.py end to end: the JSON it writes, the parallel config, and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "tools" / "autoconfig.py"), *args], capture_output=True,
                          text=True, timeout=120, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})


def test_plan_json_and_parallel_config(tmp_path):
    out = tmp_path / "plan.json"
    res = _run("model=llama2-7b", "cluster=dgx-a100-80gb", "autoconfig.nodes=2", "train.global_batch_size=64",
               "train.seq_length=4096", "train.precision=bf16", "autoconfig.fixed.tp=2", f"autoconfig.output={out}")
    assert res.returncode == 0, res.stderr[-2000:]
    d = json.loads(out.read_text())
    assert set(d["plan"]) == {"dp", "tp", "pp", "cp", "cp_kind", "vpp", "micro_batch_size", "zero", "recompute",
                              "schedule", "sequence_parallel"}
    assert d["plan"]["tp"] == 2 and d["plan"]["dp"] * d["plan"]["tp"] * d["plan"]["pp"] == 16
    assert {"iteration_time_s", "memory_gb_per_device", "model_tflops_per_device", "breakdown"} <= set(d["predicted"])
    assert d["predicted"]["memory_gb_per_device"] <= 80
    assert d["candidates_evaluated"] > 10 and d["search_time_s"] < 60 and len(d["top"]) >= 1
    times = [t["predicted"]["iteration_time_s"] for t in d["top"]]
    assert times == sorted(times)
    yaml = (tmp_path / "plan.parallel.yaml").read_text()
    assert "tp: 2" in yaml and "pretrain with: parallel.dp=" in res.stdout


@pytest.mark.parametrize("args,needle", [
    (["cluster=dgx-z"], "unknown cluster 'dgx-z'; valid: dgx-a100-80gb"),
    (["model=llama-9000"], "valid: gpt2"),
    (["autoconfig.speed=1"], "unknown key autoconfig.speed"),
    (["autoconfig.fixed.tq=2"], "autoconfig.fixed has unknown fields ['tq']"),
    (["model=llama2-7b", "cluster=local-cpu", "train.seq_length=4096", "train.global_batch_size=4"],
     "no layout fits local-cpu x 1 node(s) (24 GB per device): the smallest need is"),
])
def test_bad_input_is_one_line(args, needle):
    res = _run(*args)
    assert res.returncode == 2, res.stderr[-2000:]
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], res.stderr
