"""The end of `make demo`: summarise the run's losses and generate a sample from the HF export.

    python tools/demo_report.py --run outputs/demo --hf outputs/demo/hf
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def loss_summary(metrics_path: Path, windows: int = 10, width: int = 40) -> str:
    """Mean loss over ~10 consecutive windows of the logged steps (single steps are noisy)."""
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    if not rows:
        raise SystemExit(f"error: {metrics_path} has no logged steps")
    size = max(1, len(rows) // windows)
    chunks = [rows[i:i + size] for i in range(0, len(rows), size)]
    means = [(c[0]["step"], c[-1]["step"], sum(r["loss"] for r in c) / len(c)) for c in chunks]
    tok_s = sum(r["tokens_per_s"] for r in rows[1:]) / max(1, len(rows) - 1)
    lo, hi = min(m for *_, m in means), max(m for *_, m in means)
    lines = [f"loss (mean per window of logged steps): {means[0][2]:.3f} -> {means[-1][2]:.3f}, "
             f"mean {tok_s:.0f} tokens/s over {rows[-1]['step']} steps"]
    for a, b, m in means:
        bar = "#" * max(1, round(width * (m - lo) / max(hi - lo, 1e-9)))
        lines.append(f"  steps {a:>4}-{b:<4} {m:7.3f}  {bar}")
    return "\n".join(lines)


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
    a = ap.parse_args(argv)
    print(loss_summary(a.run / "metrics.jsonl"))
    print(f"\nsample from {a.hf} (transformers generate, prompt {a.prompt!r}):\n" + "-" * 60)
    print(sample(a.hf, a.prompt, a.max_new_tokens, a.seed))
    print("-" * 60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
