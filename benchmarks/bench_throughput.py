"""One-process training throughput: mpformer vs transformers' LlamaForCausalLM, fp32 and bf16.

Both models get the same config (through mpformer's HF adapter), the same initial weights (HF's
init copied into mpformer through the canonical key map; the initial losses are asserted equal),
the same batches in the same order, and the same optimizer (mpformer's builder: fused AdamW, no
decay on 1-D tensors) with global-norm clipping. A step is forward + backward + clip + AdamW step
+ zero_grad; bf16 is autocast around the forward with fp32 master weights, as mpformer's trainer
runs it. The mpformer step is the trainer's: the gradient engine at ZeRO stage 0, whose gradients are
views into its flat buffers, zeroed in place (dp=1, so no communication).

Steps alternate between the two models (ABBA order, one step each per round) so that load from
other processes on the machine hits both alike; medians are reported. The matmul peak of each
dtype is measured in the same run, before and after the training rounds, on square GEMMs in all
three operand layouts that training uses. The fraction of peak counts each FLOP at the peak of the
dtype it ran in: the matmuls at the run's dtype's, the attention core's at fp32's where the CPU
kernel choice computes 16-bit attention in fp32 (parallel/kernels.py), so a bf16 run whose attention
ran in fp32 is not measured against a bf16 rate it never used.

Same training, checked: after the timed rounds the two models' losses, step by step over at least
``MIN_GUARD_STEPS`` steps, agree within the precision's tolerance (a model that ignores its input, or
trains differently, fails however fast it is). ``--compile`` compiles both alike, block by block
(mpformer's train.compile, HF's decoder layers one by one, as torchtitan compiles).

    python benchmarks/bench_throughput.py [--quick] [--json out.json] [--hidden 256 --layers 4 ...]
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is built locally; never reach a hub

import torch
from torch import nn

# Run as a script: make the sibling helpers module importable without packaging benchmarks/.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    environment,
    format_table,
    interleave,
    matmul_flops,
    median,
    merge_peaks,
    quartiles,
    write_json,
)

from mpformer.convert import adapter_for_arch
from mpformer.core.config import OptimConfig, TrainConfig
from mpformer.core.model_config import ModelConfig
from mpformer.models import Transformer
from mpformer.models.parallelize import grad_specs
from mpformer.optim.builder import build_engine, param_groups
from mpformer.optim.engine import Reduction
from mpformer.parallel.comm import Comm, CommLedger

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# --quick: a model small enough that fp32 and bf16 together finish in well under a minute.
QUICK = {"hidden": 128, "layers": 2, "heads": 4, "kv_heads": 2, "vocab": 4096, "seq": 128, "batch": 2,
         "steps": 12, "bf16_steps": 10, "warmup": 1, "bf16_warmup": 1, "peak_sizes": [512], "bf16_peak_sizes": [256]}
FLOPS_FORMULA = ("model FLOPs/step = (6 * N_matmul + 12 * L * s * n_heads * head_dim) * b * s, "
                 "N_matmul = weights of q,k,v,o,gate,up,down in every layer + the LM head "
                 "(embedding lookup and norm gains excluded); attention counted without the causal halving "
                 "(Megatron/PaLM accounting)")
Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs [b, s], next-token labels [b, s])
PARITY_RTOL = {"fp32": 1e-4, "bf16": 2e-2}  # bf16: rounding of the fused vs separate projections differs
# The losses of every step (warm-up and timed) must agree this closely: the same weights, batches and
# optimizer, summed in other orders (fp32), rounded in other places (bf16), drift apart slowly.
GUARD_RTOL = {"fp32": 1e-3, "bf16": 5e-2}
MIN_GUARD_STEPS = 10


class Runner:
    """One model with its optimizer: ``step(batch)`` runs a training step and times its phases."""

    def __init__(self, name: str, loss_fn: Callable[[Batch], torch.Tensor], update: Callable[[], None],
                 dtype: torch.dtype) -> None:
        self.name, self.loss_fn, self.update = name, loss_fn, update
        self.autocast = (lambda: torch.autocast("cpu", dtype=dtype)) if dtype != torch.float32 \
            else contextlib.nullcontext
        self.phases: list[tuple[float, float, float]] = []  # (forward, backward, clip+step+zero) seconds
        self.losses: list[float] = []

    def step(self, batch: Batch) -> float:
        t0 = time.perf_counter()
        with self.autocast():
            loss = self.loss_fn(batch)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        self.update()
        t3 = time.perf_counter()
        self.phases.append((t1 - t0, t2 - t1, t3 - t2))
        self.losses.append(float(loss.detach()))
        return t3 - t0


def build_pair(cfg: ModelConfig, seed: int, attn_impl: str | None) -> tuple[Transformer, nn.Module]:
    """HF LlamaForCausalLM with HF's init, and an mpformer Transformer holding the same weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    adapter = adapter_for_arch(cfg.arch)
    hf_dict, _ = adapter.config_to_hf(cfg)
    hf_dict.pop("model_type")
    # use_cache=False: a training step must not build a KV cache (HF's default config would).
    hf_cfg = LlamaConfig(**hf_dict, use_cache=False)
    if attn_impl is not None:
        hf_cfg._attn_implementation = attn_impl
    torch.manual_seed(seed)
    hf = LlamaForCausalLM(hf_cfg).float().train()
    mp = Transformer(cfg, seed=None).train()
    canonical = adapter.to_canonical(hf.state_dict(), cfg)
    with torch.no_grad():
        for name, t in mp.canonical_tensors().items():
            t.copy_(canonical[name])
    return mp, hf


def make_runners(cfg: ModelConfig, precision: str, seed: int, attn_impl: str | None,
                 compile_blocks: bool = False) -> tuple[dict[str, Runner], str]:
    """The two runners, and the attention implementation HF ended up using."""
    mp, hf = build_pair(cfg, seed, attn_impl)
    if compile_blocks:  # both alike: every decoder block compiled on its own (regional compilation)
        mp.compile_layers()
        for layer in hf.model.layers:
            layer.compile()
    ocfg = OptimConfig()
    dtype = DTYPES[precision]

    # mpformer: exactly the trainer's objects (the gradient engine with its specs, clipping, optimizer).
    engine = build_engine(mp, Reduction(Comm(None, CommLedger()), specs=grad_specs(mp)), 0, ocfg, "cpu",
                          TrainConfig().grad_bucket_mb)
    mp_opt = engine.optimizer

    def mp_update() -> None:
        engine.finish()
        engine.clip(ocfg.clip_grad)
        engine.step()
        engine.zero_grad()

    # HF: the same AdamW construction (groups, hyper-parameters, fused flag) on HF's parameters.
    fused = mp_opt.defaults["fused"]
    hf_opt = torch.optim.AdamW(param_groups(hf, ocfg.weight_decay), lr=ocfg.lr, betas=tuple(ocfg.betas),
                               eps=ocfg.eps, weight_decay=ocfg.weight_decay, fused=fused)
    hf_params = [p for p in hf.parameters() if p.requires_grad]

    def hf_update() -> None:
        torch.nn.utils.clip_grad_norm_(hf_params, ocfg.clip_grad)
        hf_opt.step()
        hf_opt.zero_grad(set_to_none=True)

    def hf_loss(batch: Batch) -> torch.Tensor:
        # shift_labels: the labels are already the next tokens, as mpformer's forward takes them.
        inputs, labels = batch
        return hf(input_ids=inputs, labels=labels, shift_labels=labels).loss

    runners = {"mpformer": Runner("mpformer", lambda b: mp(*b), mp_update, dtype),
               "hf": Runner("hf", hf_loss, hf_update, dtype)}
    return runners, hf.config._attn_implementation


def check_parity(runners: dict[str, Runner], batch: Batch, precision: str) -> dict[str, float]:
    """Initial losses on the same batch must agree before any timing means anything."""
    losses = {}
    with torch.no_grad():
        for name, r in runners.items():
            with r.autocast():
                losses[name] = float(r.loss_fn(batch))
    rel = abs(losses["mpformer"] - losses["hf"]) / abs(losses["hf"])
    if not math.isfinite(rel) or rel > PARITY_RTOL[precision]:
        raise AssertionError(f"{precision}: initial losses differ: mpformer {losses['mpformer']:.6f} vs "
                             f"HF {losses['hf']:.6f} (rel {rel:.2e} > {PARITY_RTOL[precision]})")
    return {**losses, "rel_diff": rel}


def flops_per_step(cfg: ModelConfig, batch: int, seq: int) -> tuple[float, int, float]:
    """Model FLOPs of one training step (see FLOPS_FORMULA), N_matmul, and the attention core's share."""
    h, f, d = cfg.hidden_size, cfg.ffn_size, cfg.head_size
    q, kv = cfg.num_attention_heads * d, cfg.kv_heads * d
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * f
    n_matmul = cfg.num_layers * per_layer + h * cfg.vocab_size
    attention = 12 * cfg.num_layers * seq * q
    return float((6 * n_matmul + attention) * batch * seq), n_matmul, float(attention * batch * seq)


def ideal_seconds(precision: str, flops: float, attention: float, peaks: dict[str, float]) -> dict[str, float]:
    """Per model, the step's FLOPs at the peak of the dtype each ran in: matmuls at the run's dtype's;
    mpformer's attention at fp32's where its CPU kernel choice computes 16-bit attention in fp32."""
    from mpformer.parallel.kernels import cpu_attention

    run = peaks[precision]
    mp_attn = peaks.get("fp32", run) if precision != "fp32" and cpu_attention(DTYPES[precision]).upcast else run
    return {"mpformer": (flops - attention) / run + attention / mp_attn, "hf": flops / run}


def measure(args: argparse.Namespace, cfg: ModelConfig, precision: str) -> dict:
    runners, attn = make_runners(cfg, precision, args.seed, args.hf_attn, args.compile)
    g = torch.Generator().manual_seed(args.seed)
    data = torch.randint(0, cfg.vocab_size, (4, args.batch, args.seq + 1), generator=g)
    # Inputs and next-token labels, split once and contiguous (HF's loss .view()s its labels).
    batches = [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in data]
    parity = check_parity(runners, batches[0], precision)
    steps, warmup = (args.steps, args.warmup) if precision == "fp32" else (args.bf16_steps, args.bf16_warmup)
    counters = dict.fromkeys(runners, 0)

    def one_step(name: str) -> list[float]:
        i = counters[name]
        counters[name] += 1  # each model sees the same batch sequence
        return [runners[name].step(batches[i % len(batches)])]

    interleave({n: (lambda n=n: one_step(n)) for n in runners}, warmup)
    for r in runners.values():
        r.phases.clear()
    times = interleave({n: (lambda n=n: one_step(n)) for n in runners}, steps)
    guard = same_training(runners, precision)
    return {"runners": runners, "times": times, "parity": parity, "steps": steps, "warmup": warmup, "attn": attn,
            "guard": guard}


def same_training(runners: dict[str, Runner], precision: str) -> dict:
    """Both models' losses, step by step: at least MIN_GUARD_STEPS, each within GUARD_RTOL."""
    mp, hf = runners["mpformer"].losses, runners["hf"].losses
    if len(mp) < MIN_GUARD_STEPS:
        raise SystemExit(f"{precision}: {len(mp)} steps per model are too few to check the two train alike "
                         f"(at least {MIN_GUARD_STEPS}: raise --steps / --bf16-steps)")
    rel = [abs(a - b) / abs(b) for a, b in zip(mp, hf)]
    if max(rel) > GUARD_RTOL[precision]:
        worst = max(range(len(rel)), key=rel.__getitem__)
        raise AssertionError(f"{precision}: the losses part at step {worst + 1}: mpformer {mp[worst]:.6f} vs HF "
                             f"{hf[worst]:.6f} (rel {rel[worst]:.2e} > {GUARD_RTOL[precision]})")
    return {"steps": len(mp), "max_rel_diff": max(rel), "mpformer": mp, "hf": hf}


def summarize(precision: str, m: dict, tokens: int, flops: float, ideal_s: dict[str, float]) -> list[dict]:
    """``ideal_s``: per model, the step's FLOPs each at the peak of the dtype it ran in (seconds)."""
    times, runners = m["times"], m["runners"]
    hf_med = median(times["hf"])
    paired = [h / t for h, t in zip(times["hf"], times["mpformer"])]  # per round: drift cancels
    rows = []
    for name, ts in times.items():
        med = median(ts)
        q25, q75 = quartiles(ts)
        fwd, bwd, upd = (median([p[i] for p in runners[name].phases]) for i in range(3))
        rows.append({
            "precision": precision, "impl": name, "steps": len(ts), "tokens_per_s": tokens / med,
            "step_ms": 1e3 * med, "step_ms_q25": 1e3 * q25, "step_ms_q75": 1e3 * q75,
            "ratio_vs_hf": hf_med / med,
            "paired_ratio_median": median(paired) if name == "mpformer" else 1.0,
            "model_tflops": flops / med / 1e12, "fraction_of_peak": ideal_s[name] / med,
            "forward_ms": 1e3 * fwd, "backward_ms": 1e3 * bwd, "clip_step_zero_ms": 1e3 * upd,
            "initial_loss": m["parity"][name], "final_loss": runners[name].losses[-1],
        })
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=None, help="default: 8/3 * hidden rounded up to a multiple of 64")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=256, help="tokens per sample the model sees")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=30, help="timed fp32 steps per model (interleaved)")
    p.add_argument("--compile", action="store_true", help="both models' blocks under torch.compile")
    p.add_argument("--bf16-steps", type=int, default=10, help="timed bf16 steps per model (bf16 is slow on CPUs "
                                                             "without AVX512-BF16/AMX)")
    p.add_argument("--warmup", type=int, default=2, help="untimed fp32 steps per model")
    p.add_argument("--bf16-warmup", type=int, default=1, help="untimed bf16 steps per model")
    p.add_argument("--precision", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    p.add_argument("--hf-attn", default=None, help="HF attn_implementation (default: HF's own default)")
    p.add_argument("--peak-sizes", type=int, nargs="+", default=[1024, 2048], help="fp32 GEMM sizes")
    p.add_argument("--bf16-peak-sizes", type=int, nargs="+", default=[512, 1024], help="bf16 GEMM sizes")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help=f"small model, few steps (< 60 s): {QUICK}")
    p.add_argument("--json", default=None, help="write the results to this file")
    args = p.parse_args(argv)
    if args.quick:  # quick changes the defaults; flags given explicitly still win
        p.set_defaults(**QUICK)
        args = p.parse_args(argv)
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    ffn = args.ffn or 64 * math.ceil(8 * args.hidden / 3 / 64)
    cfg = ModelConfig(arch="llama", num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                      num_kv_heads=args.kv_heads, ffn_hidden_size=ffn, vocab_size=args.vocab,
                      max_position_embeddings=max(args.seq, 128)).validate()
    tokens = args.batch * args.seq
    flops, n_matmul, attention = flops_per_step(cfg, args.batch, args.seq)
    sizes = {"fp32": args.peak_sizes, "bf16": args.bf16_peak_sizes}
    peak_dtypes = sorted({*args.precision, "fp32"})  # fp32's too: a 16-bit run's attention may run in it
    t_start, env = time.perf_counter(), environment()
    before = {p: matmul_flops(DTYPES[p], sizes[p]) for p in peak_dtypes}
    measured = {p: measure(args, cfg, p) for p in args.precision}
    peaks = {p: merge_peaks(before[p], matmul_flops(DTYPES[p], sizes[p])) for p in peak_dtypes}
    best = {p: max(peaks[p].values()) for p in peak_dtypes}
    rows = [r for p in args.precision
            for r in summarize(p, measured[p], tokens, flops, ideal_seconds(p, flops, attention, best))]
    attn = next(iter(measured.values()))["attn"]
    load_end = os.getloadavg()[0]

    print(f"model: llama L={cfg.num_layers} h={cfg.hidden_size} heads={cfg.num_attention_heads}/"
          f"{cfg.kv_heads} kv ffn={cfg.ffn_size} vocab={cfg.vocab_size} | batch {args.batch} x seq {args.seq} = "
          f"{tokens} tokens/step | {cfg.num_params() / 1e6:.2f}M params, N_matmul {n_matmul / 1e6:.2f}M | "
          f"HF attn_implementation={attn}, use_cache=False | threads={torch.get_num_threads()} | "
          f"load avg (1 min) at start {env['load_avg_1m']:.2f}, at end {load_end:.2f}")
    print(FLOPS_FORMULA + f" = {flops / 1e9:.2f} GFLOP/step")
    for p in peak_dtypes:
        top = max(peaks[p], key=peaks[p].get)
        detail = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in peaks[p].items())
        print(f"{p} matmul peak {peaks[p][top] / 1e9:.1f} GFLOP/s ({top}); GFLOP/s by size_layout: {detail}")
    for p in args.precision:
        g = measured[p]["guard"]
        print(f"{p}: the same training, {g['steps']} steps of losses within {g['max_rel_diff']:.1e} relative "
              f"(bound {GUARD_RTOL[p]:g}); compiled: {args.compile}")
    print()
    print(format_table(
        ["precision", "impl", "tokens/s (median)", "step ms", "ratio vs HF", "model TFLOP/s",
         "fraction of peak (each FLOP at its dtype's)"],
        [[r["precision"], r["impl"], r["tokens_per_s"], r["step_ms"], r["ratio_vs_hf"], r["model_tflops"],
          r["fraction_of_peak"]] for r in rows]))
    print()
    print(format_table(
        ["precision", "impl", "forward ms", "backward ms", "clip+step+zero ms", "step ms q25-q75", "paired ratio"],
        [[r["precision"], r["impl"], r["forward_ms"], r["backward_ms"], r["clip_step_zero_ms"],
          f"{r['step_ms_q25']:.1f}-{r['step_ms_q75']:.1f}", r["paired_ratio_median"]] for r in rows]))
    print("\ntimed steps per model (interleaved ABBA, after warm-up): "
          + ", ".join(f"{p} {measured[p]['steps']} (+{measured[p]['warmup']})" for p in args.precision)
          + f" | total {time.perf_counter() - t_start:.1f} s")

    payload = {
        "benchmark": "throughput", "env": {**env, "load_avg_1m_end": load_end}, "args": vars(args),
        "model": cfg.to_dict(),
        "hf_attn_implementation": attn, "tokens_per_step": tokens, "flops_per_step": flops,
        "n_matmul_params": n_matmul, "flops_formula": FLOPS_FORMULA,
        "matmul_peak_flops": {p: {"best": best[p], "by_size_layout": peaks[p]} for p in peak_dtypes},
        "attention_flops_per_step": attention,
        "parity": {p: measured[p]["parity"] for p in args.precision},
        "same_training": {p: measured[p]["guard"] for p in args.precision},
        "results": rows,
    }
    if args.json:
        write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
