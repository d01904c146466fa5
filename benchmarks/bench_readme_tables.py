"""The README's computed tables as JSON: the schedules side by side and the auto-configurator's example.

    python benchmarks/bench_readme_tables.py --out benchmarks/results     # a few seconds

Neither is a measurement (the simulator and the cost model compute them), but each is a figure the
README shows, so each has its file: ``schedule_table_pp4_m16.json`` (``tools/schedule.py --table --pp 4
--microbatches 16``), ``autoconfig_example_plan.json`` (the README's ``tools/autoconfig.py
model=llama3-8b cluster=dgx-h100 autoconfig.nodes=4 ...`` with ``autoconfig.explain=true``) and
``autoconfig_example_fp8_plan.json`` (the same at ``train.precision=fp8``: the README's fp8 comparison).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_json

ROOT = Path(__file__).resolve().parents[1]
AUTOCONFIG = ["model=llama3-8b", "cluster=dgx-h100", "autoconfig.nodes=4", "train.global_batch_size=512",
              "train.seq_length=4096", "train.precision=bf16", "autoconfig.explain=true"]


def autoconfig_example(out: Path, args: list[str]) -> list[str]:
    """Run tools/autoconfig.py with ``args``; write its command, explanation lines and plan to ``out``."""
    with tempfile.TemporaryDirectory() as tmp:
        plan = Path(tmp) / "plan.json"
        cmd = [sys.executable, str(ROOT / "tools" / "autoconfig.py"), *args, f"autoconfig.output={plan}"]
        res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if res.returncode != 0:
            raise SystemExit(f"tools/autoconfig.py failed:\n{res.stderr[-2000:]}")
        lines = [x for x in res.stdout.splitlines() if x.startswith(("the runner-up is", "the baseline is"))]
        write_json(out, {"command": "tools/autoconfig.py " + " ".join(args), "explain_lines": lines,
                         "plan": json.loads(plan.read_text())})
    return lines


def main(argv: list[str] | None = None) -> int:
    from mpformer.pipeline.compare import schedule_table

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    a = ap.parse_args(argv)
    write_json(a.out / "schedule_table_pp4_m16.json", {"pp": 4, "microbatches": 16, "rows": schedule_table(4, 16)})
    for name, args in (("autoconfig_example_plan.json", AUTOCONFIG),
                       ("autoconfig_example_fp8_plan.json", [*AUTOCONFIG[:-2], "train.precision=fp8", AUTOCONFIG[-1]])):
        print(name, *autoconfig_example(a.out / name, args), sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
