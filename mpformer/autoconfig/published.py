"""The published runs of published_runs.json (beside this module) as auto-configurator inputs.

Korthikanti et al. 2022 (A100 80GB, GPT-3-style models, s=2048, V=51200, no FlashAttention yet) and
the Llama 3 405B runs (H100, 126 layers, GQA). ``published_cases`` returns, per row, the model, the
cluster, the workload, the published layout to pin, and the published figure (iteration seconds, or
TFLOP/s per GPU) for the comparison table and its test.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpformer.autoconfig.cluster import Cluster, load_cluster
from mpformer.autoconfig.memory import Workload
from mpformer.core.model_config import ModelConfig

# The published large runs the cost model is checked against (sources in each row), kept in the package.
REFERENCE = Path(__file__).resolve().parent / "published_runs.json"


@dataclass(frozen=True)
class Case:
    name: str
    model: ModelConfig
    cluster: Cluster
    workload: Workload
    fixed: dict[str, Any]
    iteration_time_s: float | None = None  # Korthikanti rows
    tflops_per_gpu: float | None = None  # Llama 3 rows


def published_cases(path: Path = REFERENCE) -> list[Case]:
    d = json.loads(path.read_text())
    out = []
    for r in d["korthikanti_2022"]:
        m = ModelConfig(arch="gpt2", num_layers=r["layers"], hidden_size=r["hidden"], num_attention_heads=r["heads"],
                        vocab_size=r["vocab"], activation="gelu_tanh", attention_bias=True, mlp_bias=True,
                        max_position_embeddings=r["seq"])
        vpp = 3 if r["model"] in ("175B", "530B") else 1  # "interleaving with 3 chunks for 175B and 530B"
        c = load_cluster("dgx-a100-80gb", nodes=max(1, r["gpus"] // 8))
        w = Workload(r["global_batch"], r["micro_batch"], r["seq"], "bf16", flash_attention=False)
        for rec, key in (("selective", "iteration_time_s"), ("full", "full_recompute_iteration_time_s")):
            fixed = {"tp": r["tp"], "pp": r["pp"], "dp": 1, "cp": 1, "micro_batch_size": r["micro_batch"],
                     "recompute": rec, "sequence_parallel": r["sequence_parallel"], "vpp": vpp, "zero": 0,
                     "schedule": "interleaved" if vpp > 1 else "1f1b"}
            out.append(Case(f"{r['model']} {rec}", m, c, w, fixed, iteration_time_s=r[key]))
    for r in d["llama3_405b"]:
        m = ModelConfig(arch="llama", num_layers=126, hidden_size=16384, num_attention_heads=128, num_kv_heads=8,
                        ffn_hidden_size=53248, vocab_size=128256, max_position_embeddings=r["seq"], rope_theta=500000.0)
        c = load_cluster("dgx-h100", nodes=r["gpus"] // 8)
        w = Workload(r["dp"] * r["batch_per_dp"], 1, r["seq"], "bf16")
        fixed = {"tp": r["tp"], "pp": r["pp"], "dp": r["dp"], "cp": r["cp"]}
        out.append(Case(f"405B {r['gpus']} GPUs cp={r['cp']}", m, c, w, fixed, tflops_per_gpu=r["tflops_per_gpu"]))
    return out
