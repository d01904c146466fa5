"""`make demo-moe` in miniature, through the same CLIs and the same experiment (configs/experiment/moe-demo.yaml:
Mixtral style, 8 experts top 2, dp=2 ep=2 on 2 gloo ranks, aux loss on), at 16 steps on a 1 MB demo corpus:

demo corpus -> torchrun pretrain -> mpformer-to-hf conversion -> tools/demo_report.py (with --ckpt),
then transformers as the oracle: the export's logits equal our checkpoint's on corpus tokens (fp32,
max |diff| <= 1e-5 * max |logit|, as tests/integration/test_hf_moe_parity.py), and it generates.
As tests/integration/test_end_to_end.py does for the dense path. ~40 s on 2 cores.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

from mpformer.cli.convert import main as convert_main
from mpformer.testing.cli import REPO, run_cli

STEPS, SEQ, TOL = 16, 64, 1e-5


def _load_tool(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_moe_demo_trains_exports_and_generates(tmp_path: Path, capsys):
    from mpformer.data.demo_corpus import PREFIX_NAME, build_demo
    from mpformer.data.indexed import IndexedDataset

    data = tmp_path / "demo_data"
    build_demo(data, max_bytes=1_000_000)  # the demo's corpus, cut to 1 MB: ~2 s instead of ~8
    env = {"MPFORMER_DEMO_DIR": str(data)}
    run = tmp_path / "run"
    res = run_cli(["pretrain/pretrain_gpt.py", "experiment=moe-demo", f"train.steps={STEPS}", "optim.warmup_steps=4",
                   "checkpoint.save_interval=0", "checkpoint.keep=0", "logging.interval=1", "logging.progress=false",
                   "logging.wandb.mode=disabled", f"hydra.run.dir={run}"], torchrun=2, timeout=180, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert sum(r["loss"] for r in rows[-4:]) < sum(r["loss"] for r in rows[:4]) - 4 * 0.5, "the loss falls"
    # Every layer is sparse and reported; the experts really are split over the ranks (ep's all-to-all ran).
    assert all(f"moe/layer{i}/load_max_mean" in rows[-1] for i in range(4))
    assert all(r["moe/dropped"] == 0.0 and r["moe/aux_loss"] > 0 for r in rows)
    assert rows[-1]["comm_bytes_by_kind"].get("ep.all_to_all", 0) > 0

    # The conversion and the report in this process (what their scripts call): two interpreter starts saved.
    hf = tmp_path / "hf"
    assert convert_main(["mpformer-to-hf", "--ckpt", str(run / "checkpoints"), "--out", str(hf)]) == 0
    report = _load_tool("demo_report")
    assert report.main(["--run", str(run), "--hf", str(hf), "--ckpt", str(run / "checkpoints"),
                        "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "max/mean expert load, worst layer" in out and "MixtralForCausalLM" in out, out

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mpformer.checkpoint.io import load_checkpoint
    from mpformer.checkpoint.manifest import read_manifest
    from mpformer.core.model_config import ModelConfig
    from mpformer.models import Transformer

    model = AutoModelForCausalLM.from_pretrained(hf).eval()
    assert type(model).__name__ == "MixtralForCausalLM"
    assert (model.config.num_local_experts, model.config.num_experts_per_tok) == (8, 2)
    ours = Transformer(ModelConfig.from_dict(read_manifest(run / "checkpoints")["model"]), seed=None).eval()
    load_checkpoint(run / "checkpoints", ours)
    # Real text, not random ids: the trained routers then send tokens where training sent them.
    stream = np.asarray(IndexedDataset(data / PREFIX_NAME).tokens[: 2 * SEQ], dtype=np.int64)
    tokens = torch.from_numpy(stream).view(2, SEQ)
    with torch.no_grad():
        ref, got = model(tokens).logits, ours(tokens)
    assert ref.dtype == got.dtype == torch.float32
    assert (got - ref).abs().max() <= TOL * ref.abs().max()

    tok = AutoTokenizer.from_pretrained(hf)
    ids = tok("def ", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.eos_token_id)
    assert out.shape[1] > ids.shape[1] and tok.decode(out[0]).startswith("def ")
