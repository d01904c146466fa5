"""The committed rehearsal table (benchmarks/results/rehearsal_memory.json, benchmarks/bench_rehearsal.py)
holds what docs/architecture.md promises: the memory model within 5% of every rehearsed rank, on the
layouts the rehearsal issue names, and the table's model column is today's memory model (a change to
autoconfig/memory.py that moves a row fails here until the table is rehearsed again)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

TABLE = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "rehearsal_memory.json"


def test_the_rehearsal_table_meets_the_memory_model():
    from mpformer.cli.compose import compose_config
    from mpformer.rehearsal.report import predicted
    from mpformer.training.preflight import preflight_rehearsal

    rows = json.loads(TABLE.read_text())["rows"]
    names = {r["layout"] for r in rows}
    assert len(names) >= 8 and all(any(k in n for n in names) for k in ("405B", "zero3", "cp2", "interleaved"))
    for r in rows:
        assert abs(r["predicted_peak_bytes"] / r["peak_bytes"] - 1) <= 0.05, (r["layout"], r["rank"])
        spec = preflight_rehearsal(compose_config([*r["overrides"], "train.precision=bf16"]), r["world_size"])
        now = predicted(spec.cfg, spec.layout, r["coords"]["pp"])["predicted_peak_bytes"]
        assert now == pytest.approx(r["predicted_peak_bytes"], rel=1e-9), (r["layout"], r["rank"], now)
