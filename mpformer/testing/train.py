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
            "val_losses": [m["val_loss"] for m in rows if "val_loss" in m],
            "offload_bytes": [m["offload_bytes"] for m in rows if "offload_bytes" in m]}


def initial_weights(args: list[str]) -> list[tuple[str, tuple[int, ...], tuple[int, ...], Any]]:
    """The weights this rank starts training from, as the trainer built them (meta device, then filled
    by the gradient engine), before any step: ``(canonical name, global shape, offsets, tensor)`` for
    every chunk it would save (ZeRO-3 and 16-bit runs: the fp32 masters)."""
    from mpformer.checkpoint.io import MODEL_PREFIX
    from mpformer.cli.compose import compose_config
    from mpformer.core.shards import stored_name
    from mpformer.parallel.device import resolve_device
    from mpformer.parallel.groups import ProcessGroups
    from mpformer.parallel.launch import world_size_from_env
    from mpformer.training.build import build_run
    from mpformer.training.preflight import preflight_train

    spec = preflight_train(compose_config(args), world_size_from_env())
    spec.run_dir.mkdir(parents=True, exist_ok=True)
    parts = build_run(spec, ProcessGroups.build(spec.layout, resolve_device(spec.cfg.train.device)))
    parts.loader.close()
    for m in parts.model.modules():  # vocabulary padding rows (tp) start at 0, where they are held whole
        valid = getattr(m, "valid", None)
        if valid is not None and m.weight.untyped_storage().nbytes():
            assert not m.weight[valid:].any(), "vocabulary padding rows must start at 0"
    return [(stored_name(k, sh)[len(MODEL_PREFIX):], tuple(sh.global_shape), tuple(sh.offsets),
             sh.local.detach().clone()) for k, sh in parts.engine.tensors().items() if k.startswith(MODEL_PREFIX)]


def assemble(per_rank: list[list[tuple[str, tuple[int, ...], tuple[int, ...], Any]]]) -> dict[str, Any]:
    """Whole tensors from every rank's chunks; each element must be covered, and chunks that overlap
    (replicas: tensor-parallel kv heads, norms, data-parallel copies) must agree exactly."""
    import torch

    out: dict[str, torch.Tensor] = {}
    seen: dict[str, torch.Tensor] = {}
    for chunks in per_rank:
        for name, shape, offsets, t in chunks:
            full = out.setdefault(name, torch.zeros(shape, dtype=t.dtype))
            mask = seen.setdefault(name, torch.zeros(shape, dtype=torch.bool))
            index = tuple(slice(o, o + n) for o, n in zip(offsets, t.shape))
            old, was = full[index], mask[index]
            assert torch.equal(old[was], t[was]), f"{name}: overlapping chunks differ at {offsets}"
            full[index] = t
            mask[index] = True
    missing = [n for n, m in seen.items() if not bool(m.all())]
    assert not missing, f"no rank holds part of {missing}"
    return out


def single_device_weights(args: list[str]) -> dict[str, Any]:
    """The canonical tensors of the single-device model of a run's config and seed (the oracle of
    ``initial_weights``)."""
    from mpformer.cli.compose import compose_config
    from mpformer.models.transformer import Transformer

    cfg = compose_config(args).cfg
    return Transformer(cfg.model, seed=cfg.train.seed).canonical_tensors()
