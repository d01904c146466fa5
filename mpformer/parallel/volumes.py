"""Analytic communication volumes (docs/formulas.md), per rank, ring-adjusted.

The same numbers the CommLedger records, derived from the model shape alone: tests compare the
two, benchmarks print their ratio, and the auto-configurator's cost model uses them.
"""

from __future__ import annotations

from mpformer.core.model_config import ModelConfig
from mpformer.parallel.tensor_parallel import kv_replicas


def tp_step_bytes(cfg: ModelConfig, s: int, b: int, t: int, sp: bool) -> dict[str, float]:
    """Ring-adjusted bytes per rank for one forward + backward (fp32), from docs/formulas.md:
    per layer 2 all-reduces of s*b*h in forward and 2 in backward, or under SP an all-gather plus a
    reduce-scatter for each, and 2 all-gathers more in backward (the column-parallel linears gather
    their inputs again: they keep only the shard, layers/linear.py). The same rule covers the
    embedding (forward) and the LM-head input (backward); the vocab-parallel cross entropy adds 3
    all-reduces of s*b floats; replicated parameters whose gradients are partial (SP: norms, row
    biases, positions; replicated kv heads) are all-reduced once."""
    e, n_sbh, n_tok, L, h = 4, s * b * cfg.hidden_size, s * b, cfg.num_layers, cfg.hidden_size
    ar, g = 2 * (t - 1) / t, (t - 1) / t
    out = {"tp.all_reduce": ar * 3 * n_tok * e, "tp.all_gather": 0.0, "tp.reduce_scatter": 0.0}
    if sp:
        out["tp.reduce_scatter"] = (4 * L + 2) * g * n_sbh * e
        out["tp.all_gather"] = (6 * L + 2) * g * n_sbh * e
        norms = (2 * L + 1) * h * (2 if cfg.norm_bias else 1)
        row_biases = 2 * L * h if cfg.mlp_bias else 0
        positions = cfg.max_position_embeddings * h if cfg.learned_positions else 0
        out["tp.all_reduce"] += ar * (norms + row_biases + positions) * e
    else:
        out["tp.all_reduce"] += (4 * L + 2) * ar * n_sbh * e
    reps = kv_replicas(t, cfg.kv_heads)
    if reps > 1:  # k and v: one head of weights (and biases) per rank, summed over its replica group
        kv = 2 * cfg.head_size * (h + (1 if cfg.attention_bias else 0))
        out["tp.all_reduce"] += L * 2 * (reps - 1) / reps * kv * e
    return out
