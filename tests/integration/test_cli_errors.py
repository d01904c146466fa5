"""Bad input to every CLI: one ``error:`` line on stderr, exit 2, no traceback, within 10 s.

The cases come from a sweep of realistic mistakes over all six CLIs (pretrain, evaluate, convert,
preprocess, autoconfig, schedule) that the other tests did not cover: argparse's own errors, empty
or misplaced files, outputs that cannot be written, values that used to be accepted silently.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mpformer.data.tokenizer import train_byte_level_bpe
from mpformer.testing.cli import run_cli, run_clis


def _cases(tmp: Path, data: str) -> dict[str, tuple[list[str], list[str]]]:
    (tmp / "empty.npy").write_bytes(b"")
    np.save(tmp / "zero_rows.npy", np.zeros((0, 33), dtype=np.int64))
    (tmp / "empty.jsonl").write_text("")
    (tmp / "adir").mkdir()
    (tmp / "afile").write_text("x")
    (tmp / "bad_cluster.yaml").write_text("name: [unclosed\n")
    from transformers import LlamaConfig

    hf = tmp / "hf_trunc"
    LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=64).save_pretrained(hf)
    (hf / "model.safetensors").write_bytes(b"\x10" * 1000)
    tok = train_byte_level_bpe(["the quick brown fox jumps over the lazy dog\n"] * 20, tmp / "tok", vocab_size=280)
    pre = ["pretrain/pretrain_gpt.py", "model=tiny-llama", f"data.paths=[{data}]", "train.seq_length=32",
           "train.global_batch_size=2", "train.micro_batch_size=2", "train.device=cpu", f"hydra.run.dir={tmp / 'run'}"]
    auto = ["tools/autoconfig.py", "model=tiny-llama", "cluster=dgx-h100", "train.global_batch_size=64",
            "train.seq_length=128"]
    sched = ["tools/schedule.py", "--schedule", "1f1b", "--pp", "4", "--microbatches", "8"]
    return {
        "convert: argparse choice": (["tools/convert_checkpoint.py", "hf2mpformer", "--hf", "x", "--out", "y"],
                                     ["invalid choice: 'hf2mpformer'", "hf-to-mpformer"]),
        "convert: truncated safetensors": (["tools/convert_checkpoint.py", "hf-to-mpformer", "--hf", str(hf),
                                            "--out", str(tmp / "o")], ["model.safetensors", "truncated or damaged"]),
        "preprocess: argparse int": (["tools/preprocess_data.py", "--input", "x", "--tokenizer", "t",
                                      "--output-prefix", "p", "--workers", "abc"], ["--workers", "invalid int"]),
        "preprocess: empty input": (["tools/preprocess_data.py", "--input", str(tmp / "empty.jsonl"), "--tokenizer",
                                     str(tok), "--output-prefix", str(tmp / "p")], ["empty.jsonl",
                                                                                           "no documents"]),
        "preprocess: prefix is a dir": (["tools/preprocess_data.py", "--input", "x", "--tokenizer", "t",
                                         "--output-prefix", f"{tmp / 'adir'}/"], ["is a directory", "P.bin"]),
        "schedule: argparse int": (["tools/schedule.py", "--schedule", "1f1b", "--pp", "four", "--microbatches", "8"],
                                   ["--pp", "invalid int value: 'four'"]),
        "schedule: json into a dir": ([*sched, "--json", str(tmp / "adir")], ["--json=", "is a directory"]),
        "schedule: plot type": ([*sched, "--plot", str(tmp / "s.xyz")], ["unsupported file type .xyz", ".png"]),
        "schedule: zero costs": ([*sched, "--f", "0", "--b", "0", "--w", "0"], ["more than 0"]),
        "autoconfig: fp8 on an A100": ([auto[0], auto[1], "cluster=dgx-a100-80gb", *auto[3:], "train.precision=fp8"],
                                       ["train.precision=fp8: cluster dgx-a100-80gb has no fp8 rate",
                                        "valid: fp32, bf16, fp16"]),
        "autoconfig: precisions": ([*auto, "autoconfig.precisions=[bf16,fp4]"],
                                   ["autoconfig.precisions", "fp4", "fp8"]),
        "autoconfig: top_k": ([*auto, "autoconfig.top_k=0"], ["autoconfig.top_k=0", ">= 1"]),
        "autoconfig: output under a file": ([*auto, f"autoconfig.output={tmp / 'afile' / 'plan.json'}"],
                                            ["afile is a file"]),
        "autoconfig: cluster yaml": ([*auto, f"cluster={tmp / 'bad_cluster.yaml'}"], ["bad_cluster.yaml",
                                                                                      "not valid YAML"]),
        "pretrain: empty eval tokens": ([*pre, "eval.interval=1", f"eval.tokens={tmp / 'empty.npy'}"],
                                        ["empty.npy", "not a readable .npy file (empty)"]),
        "pretrain: eval tokens without rows": ([*pre, "eval.interval=1", f"eval.tokens={tmp / 'zero_rows.npy'}"],
                                               ["batch >= 1", "[0, 33]"]),
        "pretrain: a path where a list goes": ([*pre[:2], "data.paths=/x", *pre[3:]],
                                              ["data.paths", "e.g. data.paths=[a,b]"]),
        "pretrain: blend weight": ([*pre, "data.weights=[0.0]"], ["data.weights=[0.0]", "positive sum"]),
        "evaluate: micro-batch": (["tools/evaluate.py", f"checkpoint.load={tmp / 'adir'}", "eval.micro_batch_size=0"],
                                  ["eval.micro_batch_size=0 must be >= 1"]),
        "evaluate: auto without checkpoints": (["tools/evaluate.py", "checkpoint.load=auto",
                                                f"checkpoint.save_dir={tmp / 'adir'}", "train.device=cpu"],
                                               ["checkpoint.load=auto", "no complete checkpoint"]),
    }


def test_every_cli_answers_bad_input_in_one_line(tiny_data, tmp_path):
    """One test over all the cases (each is a process of 0.1-6 s), listing every case that fails."""
    failures = []
    cases = _cases(tmp_path, tiny_data)
    results = run_clis([args for args, _ in cases.values()], timeout=60)  # two at a time
    for (name, (_, needles)), (res, took) in zip(cases.items(), results):
        lines = [x for x in res.stderr.splitlines() if x.strip()]
        ok = (res.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and took < 10
              and "Traceback" not in res.stderr and all(n in lines[0] for n in needles))
        if not ok:
            failures.append(f"{name}: rc={res.returncode} {took:.1f}s stderr={res.stderr[-600:]!r}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("flag", ["--help"])
def test_help_still_works(flag):
    res = run_cli(["tools/schedule.py", flag])
    assert res.returncode == 0 and "--schedule" in res.stdout
