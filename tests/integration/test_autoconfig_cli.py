"""tools/autoconfig.py end to end: the JSON it writes, the parallel config, and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "tools" / "autoconfig.py"), *args], capture_output=True,
                          text=True, timeout=timeout, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})


def test_plan_json_and_parallel_config(tmp_path):
    out = tmp_path / "plan.json"
    res = _run("model=llama2-7b", "cluster=dgx-a100-80gb", "autoconfig.nodes=2", "train.global_batch_size=64",
               "train.seq_length=4096", "train.precision=bf16", "autoconfig.fixed.tp=2", f"autoconfig.output={out}",
               "autoconfig.rehearse=false")
    assert res.returncode == 0, res.stderr[-2000:]
    d = json.loads(out.read_text())
    assert set(d["plan"]) == {"dp", "tp", "pp", "cp", "cp_kind", "cp_ulysses", "vpp", "micro_batch_size", "zero",
                              "recompute", "recompute_layers", "schedule", "sequence_parallel", "offload",
                              "offload_keep"}
    assert d["plan"]["tp"] == 2 and d["plan"]["dp"] * d["plan"]["tp"] * d["plan"]["pp"] == 16
    assert {"iteration_time_s", "memory_gb_per_device", "model_tflops_per_device", "breakdown"} <= set(d["predicted"])
    assert d["predicted"]["memory_gb_per_device"] <= d["usable_gb_per_device"] < 80
    assert d["candidates_evaluated"] > 10 and d["search_time_s"] < 60 and len(d["top"]) >= 1
    times = [t["predicted"]["iteration_time_s"] for t in d["top"]]
    assert times == sorted(times)
    yaml = (tmp_path / "plan.parallel.yaml").read_text()
    assert "tp: 2" in yaml and "pretrain with: parallel.dp=" in res.stdout
    assert f"cp_kind: {d['plan']['cp_kind']}\n" in yaml and f"cp_ulysses: {d['plan']['cp_ulysses']}\n" in yaml
    k = d["plan"]["recompute_layers"]
    assert f"recompute_layers: {'null' if k is None else k}\n" in yaml


def test_fp8_is_priced_and_chosen_among_the_allowed_precisions(tmp_path):
    """train.precision=fp8 (issue 35) on DGX H100s: priced alone (every plan written runs in fp8); with
    autoconfig.precisions=[bf16,fp8] both searched and the faster's precision written
    (the JSON's "precision", pretrain's overrides)."""
    base = ["model=llama-1b", "cluster=dgx-h100", "train.global_batch_size=64", "train.seq_length=2048",
            "autoconfig.rehearse=false"]
    out = tmp_path / "fp8.json"
    res = _run(*base, "train.precision=fp8", f"autoconfig.output={out}")
    assert res.returncode == 0, res.stderr[-2000:]
    d = json.loads(out.read_text())
    assert d["precision"] == "fp8"
    assert d["top"]
    assert all(t["plan"]["dp"] * t["plan"]["tp"] * t["plan"]["pp"] * t["plan"]["cp"] == 8 for t in d["top"])
    out = tmp_path / "both.json"
    res = _run(*base, "autoconfig.precisions=[bf16,fp8]", f"autoconfig.output={out}")
    assert res.returncode == 0, res.stderr[-2000:]
    both = json.loads(out.read_text())
    assert both["precision"] in ("bf16", "fp8") and f"train.precision={both['precision']}" in res.stdout
    fp8_s = d["predicted"]["iteration_time_s"]
    assert both["predicted"]["iteration_time_s"] <= fp8_s * (1 + 1e-9)


def test_the_plans_are_rehearsed_before_one_is_chosen(tmp_path):
    """The README example on a GPU cluster: each printed plan's most loaded rank is rehearsed on an H100
    (rehearsal/), its peak fits the usable memory (85.5 GB less the context, NCCL and the reserve) and is
    within 5% of the memory model's; the table, the JSON and the explanation show both figures."""
    out = tmp_path / "plan.json"
    res = _run("model=llama3-8b", "cluster=dgx-h100", "autoconfig.nodes=4", "train.global_batch_size=512",
               "train.seq_length=4096", "train.precision=bf16", "autoconfig.top_k=2", "autoconfig.explain=true",
               f"autoconfig.output={out}", timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    d = json.loads(out.read_text())
    usable = d["usable_gb_per_device"]
    assert usable == pytest.approx(85.52 * 0.96 - 3.0)
    assert f"memory: {usable:.1f} GB usable of 85.5 GB per device" in res.stdout
    assert "(rehearsed: the most loaded rank of each plan)" in res.stdout
    assert len(d["top"]) + len(d["dropped_by_rehearsal"]) == 2
    for x in d["dropped_by_rehearsal"]:  # the search fills memory to the limit: a few % decide
        assert x["rehearsed_gb"] > usable and f"rank {x['rank']} rehearsed at {x['rehearsed_gb']:.1f} GB" in res.stdout
    for t in d["top"]:
        p, r = t["predicted"], t["predicted"]["rehearsed"]
        assert r["device"] == "h100-80gb" and r["peak_gb"] <= usable
        assert p["memory_gb_per_device"] == pytest.approx(r["peak_gb"], rel=0.05), (t["plan"], p, r)
    if len(d["top"]) == 2:
        pair = d["explain"]["comparisons"][0]["memory_rehearsed_gb_per_device"]
        assert pair["chosen"] == d["top"][0]["predicted"]["rehearsed"]["peak_gb"] and pair["other"] is not None
        assert "memory rehearsed (GB)" in res.stdout


def test_long_sequence_plan_uses_context_parallelism(tmp_path):
    """128k tokens of Llama 3 8B on one 8 x H100 node: the plan splits the sequence (cp > 1); the table,
    the JSON, the overrides line and the parallel config name its cp kind."""
    out = tmp_path / "long.json"
    res = _run("model=llama3-8b", "cluster=dgx-h100", "train.global_batch_size=8", "train.seq_length=131072",
               "train.precision=bf16", "model.max_position_embeddings=131072", f"autoconfig.output={out}",
               "autoconfig.rehearse=false")
    assert res.returncode == 0, res.stderr[-2000:]
    plan = json.loads(out.read_text())["plan"]
    assert plan["cp"] > 1 and plan["cp_kind"] in ("ring", "allgather", "ulysses", "hybrid")
    assert "cp kind" in res.stdout and "cp comm" in res.stdout
    assert f"parallel.cp={plan['cp']} parallel.cp_kind={plan['cp_kind']} parallel.cp_ulysses={plan['cp_ulysses']}" \
        in res.stdout
    yaml = (tmp_path / "long.parallel.yaml").read_text()
    assert f"cp: {plan['cp']}\ncp_kind: {plan['cp_kind']}\ncp_ulysses: {plan['cp_ulysses']}\n" in yaml


@pytest.mark.parametrize("args,needle", [
    (["cluster=dgx-z"], "unknown cluster 'dgx-z'; valid: dgx-a100-80gb"),
    (["model=llama-9000"], "valid: gpt2"),
    (["autoconfig.speed=1"], "unknown config key 'autoconfig.speed'; valid keys under autoconfig: cluster"),
    (["autoconfig.fixed.tq=2"], "unknown config key 'autoconfig.fixed.tq'; valid keys under autoconfig.fixed: cp"),
    (["autoconfig.explain=maybe"], "autoconfig.explain: Value 'maybe' is not a valid bool (type str); valid: true, "
                                   "false"),
    (["model=llama2-7b", "cluster=local-cpu", "train.seq_length=4096", "train.global_batch_size=4"],
     "no layout fits local-cpu x 1 node(s) (5.6 GB usable of 6.0 GB per device, less context 0.4 GB, NCCL 0 GB, "
     "allocator reserve 0%): the smallest need is"),
])
def test_bad_input_is_one_line(args, needle):
    res = _run(*args)
    assert res.returncode == 2, res.stderr[-2000:]
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], res.stderr


def _pretrain(data: str, run_dir: Path, *extra: str) -> list[dict]:
    from mpformer.testing.cli import run_cli

    res = run_cli(["pretrain/pretrain_gpt.py", "model=tiny-llama", f"data.paths=[{data}]", "train.seq_length=32",
                   "train.steps=2", "train.global_batch_size=8", "train.device=cpu", "logging.progress=false",
                   f"hydra.run.dir={run_dir}", *extra], torchrun=2, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_pretrain_parallel_auto_trains_the_plan_and_logs_the_prediction(tiny_data, tmp_path):
    """parallel=auto under torchrun: the search's plan is the layout trained (resolved_config.yaml,
    the banner), and metrics.jsonl has the predicted step time next to the measured one. A key given on
    the command line is pinned; cluster=NAME with a fixed layout predicts that layout."""
    from omegaconf import OmegaConf

    for name, extra, check in (
        ("auto", ["parallel=auto"], {}),
        ("pinned", ["parallel=auto", "parallel.tp=2", "train.micro_batch_size=2"], {"tp": 2, "micro_batch_size": 2}),
        ("fixed", ["parallel.pp=2", "cluster=local-cpu"], {"pp": 2, "dp": 1, "tp": 1}),
    ):
        run = tmp_path / name
        rows = _pretrain(tiny_data, run, *extra)
        auto = json.loads((run / "autoconfig.json").read_text())
        plan = auto["plan"]
        assert plan["dp"] * plan["tp"] * plan["pp"] * plan["cp"] == 2 and auto["cluster"] == "local-cpu"
        assert auto["devices_per_node"] == 2 and auto["nodes"] == 1
        assert all(plan[k] == v for k, v in check.items()), (name, plan)
        assert ("candidates_evaluated" in auto) == (name != "fixed")
        resolved = OmegaConf.load(run / "resolved_config.yaml")
        for key in ("dp", "tp", "pp", "vpp", "zero", "schedule", "recompute", "sequence_parallel"):
            if not (key == "dp" and resolved.parallel.dp == -1):  # a fixed layout's dp=-1 is what is left
                assert resolved.parallel[key] == plan[key], (name, key)
        assert resolved.train.micro_batch_size == plan["micro_batch_size"]
        predicted = auto["predicted"]["iteration_time_s"]
        assert predicted > 0 and [r["predicted_step_time_s"] for r in rows] == [predicted] * 2
        assert all(r["step_time_s"] > 0 for r in rows)
