"""``mpformer-pretrain`` / ``pretrain/pretrain_gpt.py``: Hydra overrides in, a trained checkpoint out.

    torchrun --nproc_per_node=N pretrain/pretrain_gpt.py model=llama-tiny data=demo train.steps=200
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from mpformer.cli.compose import compose_config
from mpformer.core.composed import Composed
from mpformer.core.errors import ConfigError, RunHalted, user_errors_to_exit
from mpformer.parallel.launch import world_size_from_env
from mpformer.training.preflight import preflight_train
from mpformer.training.startup import StartupStop


def run_pretraining(composed: Composed) -> list[float]:
    """Validate, start (or join) the process group, train; returns the losses of the steps run."""
    # Until the first step has finished a SIGTERM ends the process at once (startup.py): nothing to save yet.
    startup = StartupStop().install()
    try:
        return _run(composed, startup)
    finally:
        startup.end()


def _run(composed: Composed, startup: StartupStop) -> list[float]:
    spec = preflight_train(composed, world_size_from_env())
    cfg, prediction = spec.cfg, spec.prediction
    # torch and friends load only once the config is known to be good: bad input exits in ~1 s.
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from mpformer.parallel.device import resolve_device
    from mpformer.parallel.groups import ProcessGroups
    from mpformer.parallel.launch import broadcast_str, init_distributed, shutdown
    from mpformer.parallel.watchdog import Heartbeat
    from mpformer.training.build import build_run
    from mpformer.training.trainer import Trainer

    device = resolve_device(cfg.train.device)
    if cfg.train.precision in ("bf16", "fp8") and not device.supports_dtype(torch.bfloat16):
        raise ConfigError(f"train.precision={cfg.train.precision} but this {device.kind} device has no bf16 support; "
                          "valid: fp32")
    if cfg.train.precision == "fp8" and not device.supports_dtype(torch.float8_e4m3fn):
        raise ConfigError(f"train.precision=fp8 but this {device.kind} device has no float8 GEMMs (compute "
                          "capability 8.9 or newer: Ada, Hopper, Blackwell); valid: bf16, fp32")
    if cfg.train.threads is not None:
        torch.set_num_threads(cfg.train.threads)
    if cfg.train.deterministic:
        device.make_deterministic()
    device.set_tf32(cfg.train.tf32)
    owns_group = not dist.is_initialized()  # tests spawn ranks with a group already up
    init_distributed(device, cfg.train.dist_timeout_s)
    # torchrun workers: a dead rank stops every rank within heartbeat_timeout_s (parallel/watchdog.py).
    heartbeat = Heartbeat.from_env(cfg.train.heartbeat_timeout_s) if owns_group else None
    try:
        groups = ProcessGroups.build(spec.layout, device)
        spec = replace(spec, run_dir=Path(broadcast_str(str(spec.run_dir))))  # rank 0's decides
        run_dir = spec.run_dir
        if groups.is_logging_rank:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "resolved_config.yaml").write_text(OmegaConf.to_yaml(spec.resolved))
            if prediction is not None:
                (run_dir / "autoconfig.json").write_text(json.dumps(prediction.to_dict(), indent=1))
                print(prediction.summary(), flush=True)
        t0 = time.perf_counter()
        trainer = Trainer(build_run(spec, groups), startup=startup)
        if heartbeat is not None:
            trainer.on_phase = heartbeat.set_phase
        losses = trainer.fit()
        if heartbeat is not None:
            heartbeat.finish()
        if groups.is_logging_rank and losses:
            k = max(1, len(losses) // 10)
            print(f"done: {len(losses)} steps in {time.perf_counter() - t0:.1f}s | loss {sum(losses[:k]) / k:.4f} "
                  f"(first {k} steps) -> {sum(losses[-k:]) / k:.4f} (last {k}) | checkpoints in {trainer.save_dir}",
                  flush=True)
        return losses
    except RunHalted:  # every rank decided it together
        if heartbeat is not None:
            heartbeat.finish()
        raise
    except BaseException as e:  # this rank alone, perhaps: the others are told, and stop too
        if heartbeat is not None:
            heartbeat.failed(e)
        raise
    finally:
        if owns_group:
            shutdown()


@user_errors_to_exit
def main(argv: list[str] | None = None) -> int:
    run_pretraining(compose_config(sys.argv[1:] if argv is None else argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
