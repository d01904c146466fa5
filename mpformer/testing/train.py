"""Run pretraining inside test ranks (spawned with a process group already up) and read back metrics."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def overrides(base: dict[str, Any], run_dir: Path, **changes: Any) -> list[str]:
    """Hydra overrides from a dict of keys, with the run directory and per-test changes applied."""
    merged = {**base, "hydra.run.dir": str(run_dir), **changes}
    return [f"{k}={v}" for k, v in merged.items()]


def train(args: list[str]) -> dict[str, list]:
    """Compose, train through the real entry point, and return losses plus the metrics.jsonl columns
    (empty on ranks other than 0, which write no metrics)."""
    from mpformer.cli.compose import compose_config
    from mpformer.cli.pretrain import run_pretraining

    composed = compose_config(args)
    losses = run_pretraining(composed)
    path = Path(composed.run_dir) / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    return {"losses": losses, "grad_norms": [m["grad_norm"] for m in rows], "steps": [m["step"] for m in rows],
            "comm_bytes": [m["comm_bytes"] for m in rows], "comm_by_kind": [m["comm_bytes_by_kind"] for m in rows],
            "grad_norms_clipped": [m["grad_norm_clipped"] for m in rows],
            "exposed_comm": [(m["exposed_comm_s"], m["exposed_comm_s_by_kind"], m["step_time_s"]) for m in rows],
            "val_losses": [m["val_loss"] for m in rows if "val_loss" in m]}
