"""``mpformer-pretrain`` / ``pretrain/pretrain_gpt.py``: Hydra overrides in, a trained checkpoint out.

    torchrun --nproc_per_node=N pretrain/pretrain_gpt.py model=llama-tiny data=demo train.steps=200
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from mpformer.cli import user_errors_to_exit
from mpformer.cli.compose import compose_config
from mpformer.parallel.device import resolve_device
from mpformer.parallel.groups import ProcessGroups
from mpformer.parallel.launch import broadcast_str, init_distributed, shutdown, world_size_from_env
from mpformer.training.preflight import preflight_train


@user_errors_to_exit
def main(argv: list[str] | None = None) -> int:
    composed = compose_config(sys.argv[1:] if argv is None else argv)
    cfg = composed.cfg
    layout = preflight_train(composed, world_size_from_env())
    device = resolve_device(cfg.train.device)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    init_distributed(device, cfg.train.dist_timeout_s)
    try:
        from mpformer.training.trainer import Trainer  # after validation: keeps bad-input exits fast

        groups = ProcessGroups.build(layout, device)
        run_dir = Path(broadcast_str(composed.run_dir))
        resolved = OmegaConf.to_container(OmegaConf.structured(cfg))
        if groups.is_logging_rank:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "resolved_config.yaml").write_text(OmegaConf.to_yaml(resolved))
        t0 = time.perf_counter()
        trainer = Trainer(cfg, layout, groups, run_dir, resolved)
        losses = trainer.fit()
        if groups.is_logging_rank and losses:
            k = max(1, len(losses) // 10)
            print(f"done: {len(losses)} steps in {time.perf_counter() - t0:.1f}s | loss {sum(losses[:k]) / k:.4f} "
                  f"(first {k} steps) -> {sum(losses[-k:]) / k:.4f} (last {k}) | checkpoints in {trainer.save_dir}",
                  flush=True)
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
