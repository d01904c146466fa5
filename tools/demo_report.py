"""The end of `make demo` and `make demo-moe`: summarise the run's losses (and, for a mixture of experts,
its expert load), check the HF export against the checkpoint, and generate a sample from the export.

    python tools/demo_report.py --run outputs/demo --hf outputs/demo/hf [--ckpt outputs/demo/checkpoints]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def read_metrics(metrics_path: Path) -> list[dict]:
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    if not rows:
        raise SystemExit(f"error: {metrics_path} has no logged steps")
    return rows


def _windows(rows: list[dict], windows: int) -> list[list[dict]]:
    size = max(1, len(rows) // windows)
    return [rows[i:i + size] for i in range(0, len(rows), size)]


def loss_summary(rows: list[dict], windows: int = 10, width: int = 40) -> str:
    """Mean loss over ~10 consecutive windows of the logged steps (single steps are noisy)."""
    chunks = _windows(rows, windows)
    means = [(c[0]["step"], c[-1]["step"], sum(r["loss"] for r in c) / len(c)) for c in chunks]
    tok_s = sum(r["tokens_per_s"] for r in rows[1:]) / max(1, len(rows) - 1)
    lo, hi = min(m for *_, m in means), max(m for *_, m in means)
    lines = [f"loss (mean per window of logged steps): {means[0][2]:.3f} -> {means[-1][2]:.3f}, "
             f"mean {tok_s:.0f} tokens/s over {rows[-1]['step']} steps"]
    for a, b, m in means:
        bar = "#" * max(1, round(width * (m - lo) / max(hi - lo, 1e-9)))
        lines.append(f"  steps {a:>4}-{b:<4} {m:7.3f}  {bar}")
    return "\n".join(lines)


def moe_summary(rows: list[dict], run_dir: Path, windows: int = 10) -> str | None:
    """The routers' story from the moe/ metrics (training/router_report.py): max/mean expert load per sparse
    layer, the auxiliary loss and the dropped share, mean over the first and the last window of logged
    steps (the windows of loss_summary). None for a dense run."""
    layers = sorted({k for r in rows for k in r if k.startswith("moe/layer") and k.endswith("/load_max_mean")},
                    key=lambda k: int(k.split("/")[1][len("layer"):]))
    if not layers:
        return None
    chunks = _windows(rows, windows)
    first, last = chunks[0], chunks[-1]

    def mean(chunk: list[dict], key: str) -> float:
        return sum(r[key] for r in chunk) / len(chunk)

    cfg = _model_config(run_dir)
    e, k = cfg.get("num_experts"), cfg.get("num_experts_per_tok")
    scale = f"1.0 = even, {e / k:.1f} = every token on the same {k} of {e} experts" if e and k else "1.0 = even"
    worst = (max(mean(first, key) for key in layers), max(mean(last, key) for key in layers))
    lines = [f"experts (moe/ metrics, mean over logged steps {first[0]['step']}-{first[-1]['step']} -> "
             f"{last[0]['step']}-{last[-1]['step']}):",
             f"  max/mean expert load, worst layer: {worst[0]:.2f} -> {worst[1]:.2f}   ({scale})",
             "  per layer: " + ", ".join(f"L{key.split('/')[1][len('layer'):]} {mean(first, key):.2f} -> "
                                         f"{mean(last, key):.2f}" for key in layers)]
    if "moe/aux_loss" in rows[0]:
        coef = cfg.get("router_aux_loss_coef")
        lines.append(f"  aux loss (unweighted; coefficient {coef}): {mean(first, 'moe/aux_loss'):.3f} -> "
                     f"{mean(last, 'moe/aux_loss'):.3f}; dropped {100 * max(r['moe/dropped'] for r in rows):.1f}% "
                     "of routed slots at most")
    return "\n".join(lines)


def _model_config(run_dir: Path) -> dict:
    """The run's model section from resolved_config.yaml ({} when the file is not there)."""
    path = run_dir / "resolved_config.yaml"
    if not path.is_file():
        return {}
    import yaml

    return (yaml.safe_load(path.read_text()) or {}).get("model", {})


def export_check(ckpt: Path, hf_dir: Path, seq: int = 64) -> str:
    """Our model from the checkpoint and transformers' from the export, in fp32, on the same (seeded random)
    tokens: max |logit diff| over max |logit| (the conversion tests hold it to 1e-5)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from mpformer.checkpoint.io import load_checkpoint
    from mpformer.checkpoint.manifest import read_manifest
    from mpformer.core.model_config import ModelConfig
    from mpformer.models import Transformer

    transformers.utils.logging.disable_progress_bar()
    ours = Transformer(ModelConfig.from_dict(read_manifest(ckpt)["model"]), seed=None).eval()
    load_checkpoint(ckpt, ours)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    tokens = torch.randint(0, ours.cfg.vocab_size, (2, seq), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ours(tokens), hf(tokens).logits
    rel = float((a - b).abs().max() / b.abs().max())
    return (f"HF export ({type(hf).__name__}) against the checkpoint, fp32, {tokens.numel()} tokens: "
            f"max |logit diff| / max |logit| = {rel:.1e}")


def sample(hf_dir: Path, prompt: str, max_new_tokens: int, seed: int) -> str:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()
    tok = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    torch.manual_seed(seed)
    ids = tok(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=True, temperature=0.8, top_k=40,
                         pad_token_id=tok.eos_token_id)
    return tok.decode(out[0], skip_special_tokens=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--run", required=True, type=Path, help="the run directory (holds metrics.jsonl)")
    ap.add_argument("--hf", required=True, type=Path, help="the Hugging Face export of the final checkpoint")
    ap.add_argument("--prompt", default="import os\n\n\ndef ")
    ap.add_argument("--max-new-tokens", type=int, default=80)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ckpt", type=Path, help="the checkpoint the export came from: compare their logits")
    a = ap.parse_args(argv)
    rows = read_metrics(a.run / "metrics.jsonl")
    print(loss_summary(rows))
    moe = moe_summary(rows, a.run)
    if moe is not None:
        print(moe)
    if a.ckpt is not None:
        print(export_check(a.ckpt, a.hf))
    print(f"\nsample from {a.hf} (transformers generate, prompt {a.prompt!r}):\n" + "-" * 60)
    print(sample(a.hf, a.prompt, a.max_new_tokens, a.seed))
    print("-" * 60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
