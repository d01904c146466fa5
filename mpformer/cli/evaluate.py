"""``mpformer-eval`` / ``tools/evaluate.py``: mean next-token loss of a checkpoint on a token file.

    torchrun ... tools/evaluate.py checkpoint.load=DIR parallel.tp=.. parallel.pp=.. eval.tokens=FILE.npy

FILE.npy holds int64 [batch, seq+1]. The last line printed is ``{"loss": float, "tokens": int}``:
the mean cross entropy over all batch*seq predicted tokens. The model config comes from the
checkpoint unless given on the command line (then it must match).
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace

from mpformer.cli.compose import compose_config
from mpformer.core.errors import ConfigError, user_errors_to_exit
from mpformer.core.layout import validate
from mpformer.parallel.launch import init_distributed, shutdown, world_size_from_env
from mpformer.training.evaluation import (
    check_pipeline_eval,
    evaluate_loss,
    load_eval_tokens,
    pipeline_evaluate_loss,
)
from mpformer.training.preflight import adopt_checkpoint_model, check_eval_rows, document_eos


@user_errors_to_exit
def main(argv: list[str] | None = None) -> int:
    composed = compose_config(sys.argv[1:] if argv is None else argv)
    cfg = composed.cfg
    if not cfg.checkpoint.load:
        raise ConfigError("checkpoint.load is not set; give checkpoint.load=DIR (a checkpoint or save directory)")
    if cfg.eval.micro_batch_size < 1:
        raise ConfigError(f"eval.micro_batch_size={cfg.eval.micro_batch_size} must be >= 1")
    model_cfg, manifest = adopt_checkpoint_model(composed)
    if manifest is None:  # checkpoint.load=auto found nothing
        raise ConfigError(f"checkpoint.load={cfg.checkpoint.load}: no complete checkpoint in the save directory "
                          "(checkpoint.save_dir); give checkpoint.load=DIR")
    tokens = load_eval_tokens(cfg.eval.tokens, model_cfg.vocab_size,
                              model_cfg.max_position_embeddings if model_cfg.learned_positions else None)
    layout = validate(cfg.parallel.layout(), model_cfg, world_size_from_env(), seq_length=tokens.shape[1] - 1)
    check_eval_rows(layout, tokens, cfg.eval.tokens)
    eos = document_eos(replace(cfg, model=model_cfg))
    if layout.pp > 1:
        check_pipeline_eval(layout, tokens.shape[0], cfg.eval.micro_batch_size)
    import torch.distributed as dist

    from mpformer.checkpoint.io import load_checkpoint
    from mpformer.core.model_options import ModelOptions
    from mpformer.models.parallelize import build_rank
    from mpformer.parallel.device import resolve_device
    from mpformer.parallel.groups import ProcessGroups

    device = resolve_device(cfg.train.device)
    owns_group = not dist.is_initialized()  # tests call main() in ranks spawned with a group already up
    init_distributed(device, cfg.train.dist_timeout_s)
    try:
        groups = ProcessGroups.build(layout, device)
        options = ModelOptions.for_run(layout, cfg.train, eos)
        rank = build_rank(model_cfg, layout, groups, options, seq_length=tokens.shape[1] - 1, seed=0)
        model, plan = rank.model.eval(), rank.plan if layout.pp > 1 else None
        load_checkpoint(manifest.path, model)
        if plan is None:
            loss, count = evaluate_loss(model, tokens, cfg.eval.micro_batch_size, device.torch_device,
                                        groups.data_comm(), layout.cp)
        else:
            loss, count = pipeline_evaluate_loss(model, plan, layout, groups, tokens, cfg.eval.micro_batch_size)
        if groups.is_logging_rank:
            print(json.dumps({"loss": loss, "tokens": count}), flush=True)
    finally:
        if owns_group:
            shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
