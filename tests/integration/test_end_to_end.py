"""The user's path in miniature (what `make demo` does at full size), through the real CLIs:

text -> tokenizer -> tools/preprocess_data.py -> torchrun pretrain (2 gloo ranks, wandb offline)
-> tools/convert_checkpoint.py mpformer-to-hf -> transformers AutoModelForCausalLM.generate.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import torch

from mpformer.testing.cli import run_cli


def test_text_to_generate(tmp_path: Path):
    from mpformer.data.tokenizer import train_byte_level_bpe

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / name).read_text() for name in ("textwrap.py", "shlex.py", "fnmatch.py", "glob.py")]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tok_dir = train_byte_level_bpe(texts, tmp_path / "tokenizer", vocab_size=320)

    prefix = tmp_path / "data" / "code_text_document"
    res = run_cli(["tools/preprocess_data.py", "--input", str(corpus), "--tokenizer", str(tok_dir),
                   "--output-prefix", str(prefix), "--workers", "1"])
    assert res.returncode == 0, res.stderr[-2000:]

    import numpy as np

    from mpformer.data.indexed import IndexedDataset

    held_out = tmp_path / "val.npy"  # validation rows: the first 4 windows of 65 tokens of the stream
    np.save(held_out, np.asarray(IndexedDataset(prefix).tokens[: 4 * 65], dtype=np.int64).reshape(4, 65))
    run = tmp_path / "run"
    res = run_cli(["pretrain/pretrain_gpt.py", "model=tiny-llama", "model.vocab_size=320",
                   f"eval.tokens={held_out}", "eval.interval=3",
                   f"data.paths=[{prefix}]", f"data.tokenizer={tok_dir}", "train.seq_length=64", "train.steps=6",
                   "train.global_batch_size=8", "train.micro_batch_size=2", "optim.lr=5e-3",
                   "checkpoint.save_interval=3", "checkpoint.keep=1", "logging.wandb.mode=offline",
                   "logging.progress=false", f"hydra.run.dir={run}"], torchrun=2, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, 7))
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    assert [m["step"] for m in metrics if "val_loss" in m] == [3, 6]
    assert metrics[5]["val_loss"] < metrics[2]["val_loss"]
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts == ["latest", "step_0000006"], "keep=1 prunes the step-3 checkpoint"
    assert (run / "checkpoints" / "step_0000006" / "tokenizer" / "tokenizer.json").is_file()

    hf = tmp_path / "hf"
    res = run_cli(["tools/convert_checkpoint.py", "mpformer-to-hf", "--ckpt", str(run / "checkpoints"),
                   "--out", str(hf)])
    assert res.returncode == 0, res.stderr[-2000:]

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf)
    model = AutoModelForCausalLM.from_pretrained(hf).eval()
    assert model.config.eos_token_id == tok.eos_token_id == 0
    ids = tok("def ", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.eos_token_id)
    assert out.shape[1] > ids.shape[1]
    assert tok.decode(out[0]).startswith("def ")
    # The exported weights are the checkpoint's: same loss on a batch through both models.
    from mpformer.checkpoint.io import load_checkpoint
    from mpformer.checkpoint.manifest import read_manifest
    from mpformer.core.model_config import ModelConfig
    from mpformer.models import Transformer

    manifest = read_manifest(run / "checkpoints")
    ours = Transformer(ModelConfig.from_dict(manifest["model"]), seed=None).eval()
    load_checkpoint(run / "checkpoints", ours)
    batch = torch.randint(0, 320, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(batch[:, :-1], batch[:, 1:]),
                                   model(input_ids=batch, labels=batch).loss, rtol=1e-5, atol=1e-6)
