"""Each part of gpu_check.sh gets its timeout from its work, rehearsed: FLOPs and bytes at the GPU's rates.

    python benchmarks/gpu_budget.py [--write]     (writes benchmarks/gpu_budget.json, which gpu_check.sh reads)

    train     the 1B run's step rehearsed (mpformer-rehearse, rank 0: its FLOPs and its model-state
              bytes, read and written about four times a step by the optimizer and the casts), times
              the steps, plus the bf16 peak GEMM measurement and the sustained-GEMM seconds
    fp8       the same run in train.precision=fp8 rehearsed the same way, its FLOPs at the bf16 rate (no
              float8 speed-up assumed: the cost model prices the 1B's eager casts above what its float8
              GEMMs save, autoconfig/fp8_terms.py), no GEMM measurement, no sustained GEMMs
    kernels   gpu_kernels.py run on meta tensors under the rehearsal's probe: every attention and GEMM
              FLOP of its cases at their repetitions
    offload   bench_offload.py's rank 0 rehearsed as pretraining builds it (OFFLOAD_RANK): its step's
              FLOPs, three modes of ``steps + 2`` steps (one untimed, one metered)
    moe       bench_expert_gemm.py run on meta tensors under the rehearsal's probe (its GPU shapes, bf16): every
              GEMM FLOP of its four methods' steps (checks, warm-up, timed), plus the bytes of the HF-indexing
              loop's whole-tensor gradients (per expert a zero gradient of x, w_up and w_down, written, then
              read twice and written by the sum: 4 passes)
    tests     not derived: pytest's start and HF models' build dominate (a fixed 150 s)

    seconds = START + work / (rate x EFFICIENCY) x MARGIN

with the H100 preset's dense bf16 rate and memory bandwidth (configs/cluster/dgx-h100.yaml), an
efficiency floor of 0.25 (these runs reach 0.3-0.5 of peak: the published H100 MFUs), START the
process's start (torch import, CUDA context, model build: 40 s) and MARGIN 2. An H200 is faster.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "gpu_budget.json"
EFFICIENCY, MARGIN, START = 0.25, 2.0, 40.0
TRAIN = ["model=llama-1b", "train.precision=bf16", "train.seq_length=2048", "train.micro_batch_size=4",
         "train.global_batch_size=8", "parallel.dp=1"]  # gpu_check.py's defaults
FP8_TRAIN = [*[o for o in TRAIN if not o.startswith("train.precision=")], "train.precision=fp8"]  # gpu_check.sh's fp8
TRAIN_STEPS, SUSTAIN_S, GEMM_CHECK_FLOPS = 30, 20.0, 13 * 2 * 8192**3  # 3 warm-up + 10 timed 8192^3 GEMMs
OFFLOAD = {"pp": 4, "microbatches": 8, "steps": 3, "layers": 16, "hidden": 1024, "vocab": 32000, "seq": 2048,
           "batch": 2}  # bench_offload.py's defaults
# bench_offload.py's rank 0 as pretraining builds it (its model: heads 16, kv heads 8, ffn 11/4 h), offload
# none (the mode that holds the most): the rank a rehearsal runs for the part's memory and FLOPs
OFFLOAD_RANK = ["model=tiny-llama", f"model.num_layers={OFFLOAD['layers']}",
                f"model.hidden_size={OFFLOAD['hidden']}", "model.num_attention_heads=16", "model.num_kv_heads=8",
                f"model.ffn_hidden_size={OFFLOAD['hidden'] * 11 // 4}",
                f"model.vocab_size={OFFLOAD['vocab']}", f"model.max_position_embeddings={OFFLOAD['seq']}",
                f"train.seq_length={OFFLOAD['seq']}", f"train.micro_batch_size={OFFLOAD['batch']}",
                f"train.global_batch_size={OFFLOAD['batch'] * OFFLOAD['microbatches']}", "train.precision=bf16",
                f"parallel.pp={OFFLOAD['pp']}", "parallel.dp=1", "parallel.schedule=1f1b", "parallel.offload=none"]

MOE_ARGS = ["--precision", "bf16"]  # gpu_check.sh's moe part, beside --device cuda


def _seconds(flops: float, nbytes: float, rates: dict) -> float:
    work = flops / (rates["flops"] * EFFICIENCY) + nbytes / (rates["bandwidth"] * EFFICIENCY)
    return round(START + work * MARGIN)


def _kernels_flops() -> int:
    import importlib.util

    from mpformer.rehearsal.probe import FunctionProbe, Probe

    spec = importlib.util.spec_from_file_location("gpu_kernels", ROOT / "benchmarks" / "gpu_kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    probe = Probe()
    probe.count_flops = True
    with probe, FunctionProbe(probe):
        module.main(["--device", "meta"])
    return probe.flops


def _moe_work() -> tuple[int, int]:
    """(FLOPs, bytes) of bench_expert_gemm.py as gpu_check.sh runs it: FLOPs counted on meta tensors, bytes
    of the HF-indexing loop's whole-tensor gradients (its ``warmup + reps + 1`` steps: the check, the
    warm-up, the timed ones)."""
    from mpformer.rehearsal.probe import FunctionProbe, Probe

    module = _bench("bench_expert_gemm")
    probe = Probe()
    probe.count_flops = True
    with probe, FunctionProbe(probe), contextlib.redirect_stdout(io.StringIO()):  # its table: of no times
        module.main(["--device", "meta", *MOE_ARGS])
    steps, bf16 = 1 + 1 + 5, 2
    nbytes = sum(steps * 4 * E * bf16 * (tokens * k * h + E * 3 * h * f) for E, k, tokens, h, f in module.GPU_SHAPES)
    return probe.flops, nbytes


def _bench(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def budgets() -> dict:
    import yaml

    from mpformer.testing.rehearsal import rehearse_many

    preset = yaml.safe_load((ROOT / "configs" / "cluster" / "dgx-h100.yaml").read_text())
    rates = {"flops": float(preset["peak_flops"]["bf16"]), "bandwidth": float(preset["memory_bandwidth"])}
    train, offload, fp8 = rehearse_many([(TRAIN, 1, 0, None), (OFFLOAD_RANK, OFFLOAD["pp"], 0, None),
                                         (FP8_TRAIN, 1, 0, None)])
    state = sum(train["peak_by_kind"][k] for k in ("weights", "grads", "master", "optimizer"))
    train_s = _seconds(train["flops"] * TRAIN_STEPS + GEMM_CHECK_FLOPS, 4 * state * TRAIN_STEPS, rates) + SUSTAIN_S
    fp8_state = sum(fp8["peak_by_kind"][k] for k in ("weights", "grads", "master", "optimizer"))
    fp8_s = _seconds(fp8["flops"] * TRAIN_STEPS, 4 * fp8_state * TRAIN_STEPS, rates)
    kernels_flops = _kernels_flops()
    offload_flops = offload["flops"] * (OFFLOAD["steps"] + 2) * 3  # steps + 1 and the metered one, 3 modes
    moe_flops, moe_bytes = _moe_work()
    return {"about": __doc__.split("\n\n")[0], "efficiency": EFFICIENCY, "margin": MARGIN, "start_s": START,
            "rates": rates, "parts": {
                "tests": {"seconds": 150, "derived": False},
                "train": {"seconds": int(train_s), "flops_per_step": train["flops"], "state_bytes": state,
                          "steps": TRAIN_STEPS, "sustain_s": SUSTAIN_S},
                "fp8": {"seconds": int(fp8_s), "flops_per_step": fp8["flops"], "state_bytes": fp8_state,
                        "steps": TRAIN_STEPS},
                "kernels": {"seconds": int(_seconds(kernels_flops, 0, rates)), "flops": kernels_flops},
                "offload": {"seconds": int(_seconds(offload_flops, 0, rates)), "flops": offload_flops},
                "moe": {"seconds": int(_seconds(moe_flops, moe_bytes, rates)), "flops": moe_flops,
                        "bytes": moe_bytes}}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help=f"write {OUT.relative_to(ROOT)}")
    args = ap.parse_args()
    b = budgets()
    for name, p in b["parts"].items():
        print(f"{name:<8} {p['seconds']:>5} s" + ("" if p.get("derived", True) else "  (fixed)"))
    print(f"total    {sum(p['seconds'] for p in b['parts'].values()):>5} s")
    if args.write:
        OUT.write_text(json.dumps(b, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
