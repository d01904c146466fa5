"""The GPU training check of gpu_check.sh: a 1B Llama on one GPU, MFU and peak memory (no checkpoint), in bf16
or in fp8 (``--precision fp8``: train.precision=fp8, issue 35) against the bf16 run's JSON (``--compare``).

Runs the pretrain CLI (torchrun, one process) on random tokens for ``--steps`` steps, then reads its
metrics.jsonl and prints, as a table and with ``--json``:

    tokens/s            median over the steps after the first ``--skip`` (allocator and autotuning warm-up)
    MFU                 model FLOPs per step (core/model_config.py model_flops_per_step: 6 N T + attention)
                        / step time / the device's dense bf16 peak (its configs/cluster preset; the measured
                        peak of an 8192^3 bf16 GEMM is printed beside it, as a ceiling the device really has)
    peak memory         torch.cuda.max_memory_allocated of the run (mem_peak_bytes in metrics.jsonl)
                        next to the memory model's prediction (autoconfig/memory.py plan_memory)
    predicted step      the cost model's step time for the same run on the device's preset
                        (autoconfig/search.py evaluate_plan), over the measured one
    sustained GEMM      8192^3 bf16 GEMMs back to back for ``--sustain`` seconds: the rate of the first
                        half second against the last third, and the SM clock (nvidia-smi) at the end.
                        The cost model's GEMM rate is the maximum achievable one measured in short bursts
                        (ml-engineering's MAMF); a device that clocks down under sustained load runs
                        training slower than that (benchmarks/README.md, bench_published: the H100
                        rows are predicted 10-16% too fast)
    fp8 against bf16    ``--precision fp8 --compare bf16.json``: the same run (same data, same initialisation)
                        with the linear layers' GEMMs in float8 (``--recipe``): its MFU against the bf16 run's
                        (both over the dense bf16 peak, so the ratio is the speed-up), the share of the FP8
                        peak its model FLOPs reach, and the loss after the last step against bf16's (a
                        relative gap above ``--loss-tol`` fails the part)

    python benchmarks/gpu_check.py [--steps 30] [--seq 2048] [--micro-batch 4] [--json out.json]
    python benchmarks/gpu_check.py --precision fp8 --sustain 0 --compare out.json [--json fp8.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import format_table, write_json  # noqa: E402

# Dense bf16 (and fp8) peaks per device (vendor data sheets), as the cluster presets hold them.
PRESETS = {"H200": "h200-node", "H100": "dgx-h100", "A100": "dgx-a100-80gb"}


def dense_peak(name: str, dtype: str = "bf16") -> tuple[float | None, str]:
    import yaml

    for key, preset in PRESETS.items():
        if key in name:
            data = yaml.safe_load((ROOT / "configs" / "cluster" / f"{preset}.yaml").read_text())
            peak = data["peak_flops"].get(dtype)
            return (float(peak) if peak else None), f"configs/cluster/{preset}.yaml"
    return None, "no preset for this device"


def measured_peak(n: int = 8192, reps: int = 10) -> float:
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * reps / (time.perf_counter() - t0)


def sustained_gemm(seconds: float, n: int = 8192) -> dict:
    """Rates of back-to-back n^3 bf16 GEMMs over ``seconds``: the first 0.5 s and the last third."""
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    flops, marks = 2 * n**3, []
    torch.cuda.synchronize()
    start = time.perf_counter()
    while (now := time.perf_counter()) - start < seconds:
        for _ in range(5):
            a @ b
        torch.cuda.synchronize()
        marks.append((time.perf_counter() - start, 5))

    def rate(lo: float, hi: float) -> float:
        picked = [(t, k) for t, k in marks if lo < t <= hi]
        if len(picked) < 2:
            return float("nan")
        return flops * sum(k for _, k in picked[1:]) / (picked[-1][0] - picked[0][0])

    try:
        clock = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.max.sm,power.draw,power.limit",
                                "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    except OSError as e:  # no nvidia-smi on the machine: the figures stand without the clocks
        clock = f"nvidia-smi: {e}"
    burst, late = rate(0.0, 0.5), rate(seconds * 2 / 3, seconds)
    return {"burst_tflops": burst / 1e12, "sustained_tflops": late / 1e12, "sustained_over_burst": late / burst,
            "seconds": now - start, "sm_clock_max_power_limit": clock}


def random_tokens(prefix: Path, vocab: int, tokens: int) -> None:
    from mpformer.data.indexed import IndexedDatasetBuilder

    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(prefix, np.int32)
    for _ in range(-(-tokens // 4096)):  # whole 4096-token documents, at least as many tokens as asked
        builder.add_document(rng.integers(1, vocab, size=4096))
    builder.finalize()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-1b")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--skip", type=int, default=5, help="first steps left out of the median")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--json", default=None)
    p.add_argument("--sustain", type=float, default=20.0, help="seconds of back-to-back GEMMs (0: skip)")
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp8"])
    p.add_argument("--recipe", default="tensorwise", choices=["tensorwise", "rowwise", "delayed"],
                   help="train.fp8.recipe under --precision fp8")
    p.add_argument("--compare", default=None, help="the bf16 run's --json: MFU and final loss against it")
    p.add_argument("--loss-tol", type=float, default=0.015, help="largest relative gap of the final loss to bf16's")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: a dry run of this script's plumbing (use a tiny --model), no MFU or memory")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():  # a check that checked nothing must not pass
        print("gpu_check.py: no CUDA device visible; nothing measured (--device cpu runs the dry run)", file=sys.stderr)
        return 2
    from mpformer.autoconfig.memory import Workload, plan_memory
    from mpformer.autoconfig.runtimes import mpformer_runtime
    from mpformer.cli.compose import compose_config
    from mpformer.core.model_config import model_flops_per_step

    recipe = [f"train.fp8.recipe={args.recipe}"] if args.precision == "fp8" else []
    overrides = [f"model={args.model}", f"train.precision={args.precision}", *recipe, f"train.seq_length={args.seq}",
                 f"train.micro_batch_size={args.micro_batch}", f"train.global_batch_size={args.global_batch}",
                 f"train.steps={args.steps}", f"train.device={args.device}", "logging.progress=false",
                 "optim.warmup_steps=2"]
    cfg = compose_config(overrides).cfg
    with tempfile.TemporaryDirectory() as tmp:
        prefix = Path(tmp) / "random_text_document"
        random_tokens(prefix, cfg.model.vocab_size, (args.steps + 2) * args.global_batch * (args.seq + 1))
        run_dir = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
               str(ROOT / "pretrain" / "pretrain_gpt.py"), *overrides, f"data.paths=[{prefix}]",
               f"hydra.run.dir={run_dir}", "checkpoint.enabled=false"]  # a 1B final save would be ~15 GB
        t0 = time.perf_counter()
        res = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        wall = time.perf_counter() - t0
        if res.returncode != 0:
            print(f"gpu_check.py: the training run failed (exit {res.returncode})")
            return 1
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = rows[args.skip:] or rows
    step_s = statistics.median(r["step_time_s"] for r in timed)
    flops = model_flops_per_step(cfg.model, args.global_batch, args.seq)
    cuda = args.device == "cuda"
    name = torch.cuda.get_device_name() if cuda else "cpu (dry run)"
    peak, source = dense_peak(name)
    gemm = measured_peak() if cuda else float("nan")
    mem = max(r["mem_peak_bytes"] for r in rows) if cuda else float("nan")
    from mpformer.autoconfig.cluster import load_cluster
    from mpformer.autoconfig.search import evaluate_plan
    from mpformer.core.layout import ParallelLayout

    work = Workload(args.global_batch, args.micro_batch, args.seq, args.precision, runtime=mpformer_runtime(cfg.train))
    predicted = plan_memory(cfg.model, ParallelLayout(dp=1), work, device="cuda")[0]  # dp=1: one GPU (not -1)
    preset = next((v for k, v in PRESETS.items() if k in name), "dgx-h100")  # the CPU dry run: any preset
    plan = evaluate_plan(cfg.model, ParallelLayout(dp=1), work, load_cluster(preset, nodes=1))
    sustained = sustained_gemm(args.sustain) if cuda and args.sustain > 0 else {}
    result = {"device": name, "torch": torch.__version__, "model": args.model, "params": cfg.model.num_params(),
              "steps": len(rows), "wall_s": wall, "step_time_s": step_s,
              "tokens_per_s": args.global_batch * args.seq / step_s, "model_tflops": flops / step_s / 1e12,
              "dense_bf16_peak_tflops": peak / 1e12 if peak else None, "peak_source": source,
              "mfu": flops / step_s / peak if peak else None, "measured_gemm_tflops": gemm / 1e12,
              "fraction_of_measured_gemm": flops / step_s / gemm, "mem_peak_gib": mem / 2**30,
              "predicted_gib": predicted.total / 2**30, "predicted_to_measured": predicted.total / mem,
              "predicted_step_s": plan.time.iteration_s, "predicted_step_over_measured": plan.time.iteration_s / step_s,
              "cost_preset": preset, **{f"gemm_{k}": v for k, v in sustained.items()},
              "loss_first_last": [rows[0]["loss"], rows[-1]["loss"]], "precision": args.precision}
    if args.precision == "fp8":
        fp8_peak, _ = dense_peak(name, "fp8")
        result |= {"recipe": args.recipe, "fraction_of_fp8_peak": flops / step_s / fp8_peak if fp8_peak else None}
    failed = False
    if args.compare:  # the bf16 run of the same model, data and initialisation
        base = json.loads(Path(args.compare).read_text())["result"]
        gap = rows[-1]["loss"] / base["loss_first_last"][1] - 1
        failed = not abs(gap) <= args.loss_tol
        result |= {"bf16_mfu": base["mfu"], "mfu_over_bf16": result["mfu"] / base["mfu"] if base["mfu"] else None,
                   "speedup_over_bf16": base["step_time_s"] / step_s, "bf16_final_loss": base["loss_first_last"][1],
                   "final_loss_gap": gap, "loss_tol": args.loss_tol}
    print(format_table(["what", "value"], [(k, v) for k, v in result.items()]))
    if args.json:
        write_json(args.json, {"result": result, "args": vars(args)})
    if failed:
        print(f"gpu_check.py: the final loss is {result['final_loss_gap']:+.2%} from bf16's (tolerance "
              f"{args.loss_tol:.1%})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
