"""HF -> mpformer -> HF through the CLI, with transformers' models as the numerical oracle.

Each tiny HF model (2 layers, hidden 64, vocab 123, random weights with random biases and norm
gains so that no mapping error can hide behind zeros or ones) is saved in fp32 with
save_pretrained, converted with ``mpformer-convert hf-to-mpformer`` (in-process), loaded into our
Transformer with load_checkpoint and compared on the same tokens:

    logits and mean next-token loss: torch.testing.assert_close(rtol=1e-5, atol=1e-5)  (fp32)

Observed on CPU: max |diff| <= ~2e-6 on logits of magnitude ~3; 0 for the Llama family under
SDPA. Then ``mpformer-to-hf`` must reproduce the original safetensors bit for bit (names, shapes,
dtypes, bytes) and AutoModelForCausalLM.from_pretrained on the output must give identical logits.

Sliding windows (Mistral, Qwen2 with every layer sliding; window 8 < sequence 32): transformers 5
builds the sliding mask in masking_utils for its default "sdpa" implementation as well as for
"eager", so both are checked; no attn_implementation override is needed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import transformers as T
from safetensors.torch import load_file

from mpformer.checkpoint.io import load_checkpoint, stored_metadata
from mpformer.checkpoint.manifest import point_latest, read_manifest
from mpformer.cli.convert import main
from mpformer.core.model_config import ModelConfig
from mpformer.models.transformer import Transformer

ROOT = Path(__file__).resolve().parents[2]
VOCAB, SEQ, BATCH = 123, 32, 2
RTOL = ATOL = 1e-5
KW = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}

CONFIGS = {
    "gpt2": lambda: T.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                 bos_token_id=1, eos_token_id=2),
    "llama": lambda: T.LlamaConfig(**KW),
    "llama-tied-llama3rope": lambda: T.LlamaConfig(**KW, tie_word_embeddings=True,
                                                   rope_parameters=dict(LLAMA3_ROPE)),
    "mistral": lambda: T.MistralConfig(**KW, sliding_window=None),
    "mistral-window8": lambda: T.MistralConfig(**KW, sliding_window=8),
    "qwen2": lambda: T.Qwen2Config(**KW),
    "qwen2-window8": lambda: T.Qwen2Config(**KW, use_sliding_window=True, sliding_window=8, max_window_layers=0),
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            is_gain = name.endswith("weight") and ("norm" in name or ".ln_" in name)
            p.copy_(1 + 0.1 * noise if is_gain else 0.1 * noise)


def _tiny_tokenizer() -> T.PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(VOCAB - 3)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return T.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    out = {}
    for i, (name, make) in enumerate(CONFIGS.items()):
        torch.manual_seed(i)
        model = T.AutoModelForCausalLM.from_config(make())
        _randomize(model, seed=i)
        d = tmp_path_factory.mktemp(name)
        # GPT-2 is saved in small shards to exercise model.safetensors.index.json reading.
        model.save_pretrained(d, max_shard_size="100KB" if name == "gpt2" else "5GB")
        if name == "llama":
            _tiny_tokenizer().save_pretrained(d)
        out[name] = d
    return out


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))


def _hf_safetensors(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _ours_logits_loss(ckpt: Path, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    model = Transformer(ModelConfig.from_dict(read_manifest(ckpt)["model"])).eval()
    load_checkpoint(ckpt, model)
    labels = torch.cat([tokens[:, 1:], torch.full((BATCH, 1), -100)], dim=1)  # ours does not shift
    with torch.no_grad():
        return model(tokens), model(tokens, labels)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hf_to_mpformer_matches_hf_and_round_trips_bit_exact(name, hf_dirs, tmp_path, capsys):
    src = hf_dirs[name]
    assert (src / "model.safetensors.index.json").is_file() == (name == "gpt2")
    ckpt = tmp_path / "mp"
    assert main(["hf-to-mpformer", "--hf", str(src), "--out", str(ckpt)]) == 0
    tokens = _tokens()
    logits, loss = _ours_logits_loss(ckpt, tokens)

    impls = ("sdpa", "eager") if "window" in name else ("sdpa",)
    for impl in impls:
        hf = T.AutoModelForCausalLM.from_pretrained(src, attn_implementation=impl).eval()
        with torch.no_grad():
            ref = hf(tokens, labels=tokens)
        torch.testing.assert_close(logits, ref.logits, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(loss, ref.loss, rtol=RTOL, atol=ATOL)
        with capsys.disabled():
            print(f"\n[{name} {impl}] max rel logit diff {_rel(logits, ref.logits):.2e}, "
                  f"rel loss diff {_rel(loss, ref.loss):.2e}")
    if "window" in name:  # the window must matter at this length, or the check above proves nothing
        cfg = ModelConfig.from_dict(read_manifest(ckpt)["model"])
        assert cfg.sliding_window == 8
        full = Transformer(ModelConfig.from_dict({**cfg.to_dict(), "sliding_window": None})).eval()
        load_checkpoint(ckpt, full)
        with torch.no_grad():
            assert (full(tokens) - logits).abs().max() > 1e-2

    back = tmp_path / "hf"
    assert main(["mpformer-to-hf", "--ckpt", str(ckpt), "--out", str(back)]) == 0
    orig, new = _hf_safetensors(src), _hf_safetensors(back)
    assert orig.keys() == new.keys()
    for k in orig:
        assert orig[k].dtype == new[k].dtype and orig[k].shape == new[k].shape, k
        assert orig[k].contiguous().view(torch.uint8).equal(new[k].contiguous().view(torch.uint8)), k
    assert json.loads((back / "generation_config.json").read_text())["eos_token_id"] == 2
    reloaded = T.AutoModelForCausalLM.from_pretrained(back).eval()
    hf = T.AutoModelForCausalLM.from_pretrained(src).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, hf(tokens).logits, rtol=0, atol=0)


def test_bf16_is_kept_both_ways(hf_dirs, tmp_path):
    src = tmp_path / "bf16"
    T.AutoModelForCausalLM.from_pretrained(hf_dirs["qwen2"], dtype=torch.bfloat16).save_pretrained(src)
    main(["hf-to-mpformer", "--hf", str(src), "--out", str(tmp_path / "mp")])
    dtypes = {dt for _, dt in stored_metadata(tmp_path / "mp").values()}
    assert dtypes == {torch.bfloat16}
    main(["mpformer-to-hf", "--ckpt", str(tmp_path / "mp"), "--out", str(tmp_path / "hf")])
    orig, new = _hf_safetensors(src), _hf_safetensors(tmp_path / "hf")
    assert orig.keys() == new.keys() and all(new[k].dtype == torch.bfloat16 and torch.equal(orig[k], new[k])
                                             for k in orig)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"


def test_tokenizer_travels_and_save_dir_with_latest(hf_dirs, tmp_path):
    src = hf_dirs["llama"]
    save_dir = tmp_path / "save"
    ckpt = save_dir / "step_0000000"
    main(["hf-to-mpformer", "--hf", str(src), "--out", str(ckpt)])
    assert read_manifest(ckpt)["tokenizer"] == "tokenizer"
    assert (ckpt / "tokenizer" / "tokenizer.json").is_file()
    point_latest(save_dir, ckpt.name)
    # --ckpt given as the save dir: resolved through `latest`; tokenizer taken from the checkpoint.
    main(["mpformer-to-hf", "--ckpt", str(save_dir), "--out", str(tmp_path / "hf")])
    text = "w5 w17 w99 w3"
    want = T.AutoTokenizer.from_pretrained(src)(text)["input_ids"]
    assert T.AutoTokenizer.from_pretrained(tmp_path / "hf")(text)["input_ids"] == want
    # --tokenizer DIR wins over the checkpoint's; small shards exercise the index writer.
    main(["mpformer-to-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "hf2"), "--tokenizer", str(src),
          "--max-shard-size-gb", str(100e3 / 2**30)])
    assert (tmp_path / "hf2" / "model.safetensors.index.json").is_file()
    assert T.AutoTokenizer.from_pretrained(tmp_path / "hf2")(text)["input_ids"] == want
    T.AutoModelForCausalLM.from_pretrained(tmp_path / "hf2")


def _error_line(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")
    return err[0]


def test_bad_inputs_exit_2_with_one_error_line(hf_dirs, tmp_path, capsys):
    # One real process for the script wrapper; the other cases in-process.
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "convert_checkpoint.py"), "hf-to-mpformer",
                           "--hf", str(tmp_path / "missing"), "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "does not exist" in lines[0]

    bin_only = tmp_path / "bin_only"
    bin_only.mkdir()
    (bin_only / "config.json").write_text(json.dumps(CONFIGS["llama"]().to_dict()))
    torch.save({}, bin_only / "pytorch_model.bin")
    assert "safetensors is required" in _error_line(capsys, ["hf-to-mpformer", "--hf", str(bin_only), "--out",
                                                             str(tmp_path / "o")])
    bert = tmp_path / "bert"
    T.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                 intermediate_size=64, architectures=["BertForMaskedLM"]).save_pretrained(bert)
    from safetensors.torch import save_file
    save_file({"x": torch.zeros(1)}, str(bert / "model.safetensors"))
    line = _error_line(capsys, ["hf-to-mpformer", "--hf", str(bert), "--out", str(tmp_path / "o")])
    assert "BertForMaskedLM is not supported" in line and "Qwen2ForCausalLM" in line
    line = _error_line(capsys, ["hf-to-mpformer", "--hf", str(hf_dirs["llama"]), "--out", str(bert)])
    assert "not an empty directory" in line
    line = _error_line(capsys, ["mpformer-to-hf", "--ckpt", str(tmp_path / "nope"), "--out", str(tmp_path / "o")])
    assert "no such directory" in line
    assert not (tmp_path / "o").exists()


EVAL_CASES = [
    ("gpt2", None, 1, 1, ""), ("llama", 2, 1, 1, ""), ("mistral-window8", None, 1, 1, ""), ("qwen2", None, 1, 1, ""),
    ("llama", 4, 4, 1, ""), ("gpt2", 2, 2, 1, ""), ("qwen2", 4, 4, 1, ""), ("llama", 2, 1, 2, ""),
    ("gpt2", 4, 2, 2, ""), ("llama", 2, 1, 1, "2 ring"), ("mistral-window8", 2, 1, 1, "2 allgather"),
    ("qwen2", 4, 2, 1, "2 ulysses"), ("gpt2", 4, 1, 2, "2 ring"), ("llama", 4, 1, 1, "4 hybrid")]
# Through the documented command (torchrun, a process per rank) at each world size; the other cases run
# the same main() inside ranks spawned once per world size (the launch is the only difference).
CLI_CASES = {EVAL_CASES[0], EVAL_CASES[5], EVAL_CASES[13]}


def _eval_args(name: str, tp: int, pp: int, cp: str, ckpt: Path, np_path: Path) -> list[str]:
    args = [f"checkpoint.load={ckpt}", f"eval.tokens={np_path}", f"eval.micro_batch_size={2 if pp == 1 else 1}",
            f"parallel.tp={tp}", f"parallel.pp={pp}"]
    if cp:
        n, kind = cp.split()
        args += [f"parallel.cp={n}", f"parallel.cp_kind={kind}", f"parallel.cp_ulysses={2 if kind == 'hybrid' else 1}"]
    return args


def _eval_in_ranks(cases: list[list[str]]) -> list[str]:
    """Each case's evaluate main() in these ranks; rank 0's printed lines."""
    import contextlib
    import io

    from mpformer.cli.evaluate import main as evaluate_main

    out = []
    for args in cases:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert evaluate_main(args) == 0
        out.append(buf.getvalue())
    return out


@pytest.fixture(scope="module")
def evaluated(hf_dirs, tmp_path_factory) -> dict:
    """Every case's checkpoint (converted from HF), HF's loss on its tokens, and evaluate's last line."""
    import numpy as np

    from mpformer.parallel.spawn import run_distributed
    from mpformer.testing.cli import run_cli

    root = tmp_path_factory.mktemp("evaluate")
    tokens = torch.randint(0, VOCAB, (3, SEQ + 1), generator=torch.Generator().manual_seed(11))
    np_path = root / "tokens.npy"
    np.save(np_path, tokens.numpy().astype(np.int64))
    refs, args, lines = {}, {}, {}
    for name in {c[0] for c in EVAL_CASES}:
        assert main(["hf-to-mpformer", "--hf", str(hf_dirs[name]), "--out", str(root / name)]) == 0
        hf = T.AutoModelForCausalLM.from_pretrained(hf_dirs[name]).eval()
        with torch.no_grad():
            refs[name] = hf(input_ids=tokens, labels=tokens).loss.item()
    for case in EVAL_CASES:
        name, ranks, tp, pp, cp = case
        args[case] = _eval_args(name, tp, pp, cp, root / name, np_path)
        if case in CLI_CASES:
            res = run_cli(["tools/evaluate.py", *args[case]], torchrun=ranks, timeout=120)
            assert res.returncode == 0, res.stderr[-3000:]
            lines[case] = res.stdout
    for world in sorted({c[1] or 1 for c in EVAL_CASES}):
        group = [c for c in EVAL_CASES if (c[1] or 1) == world and c not in CLI_CASES]
        if group:
            printed = run_distributed(_eval_in_ranks, world, args=([args[c] for c in group],), timeout=300)[0]
            lines.update(zip(group, printed))
    return {"refs": refs, "lines": lines}


@pytest.mark.parametrize("name,ranks,tp,pp,cp", EVAL_CASES)
def test_evaluate_cli_gives_the_hf_loss(name, ranks, tp, pp, cp, evaluated):
    """The documented evaluate interface on a converted checkpoint: the last line's loss is HF's (rtol 1e-5),
    also under tensor parallelism with a vocabulary (123) that tp does not divide and, for tp=4,
    fewer kv heads (2) than tp ranks, through a 2-stage pipeline (also with tp=2 and tied GPT-2
    embeddings split between the first and last stage), and under context parallelism ("cp kind":
    each kind, with Mistral's sliding window, with tp and with pp). Three cases go through the command
    itself under torchrun (CLI_CASES), the others through its main() in spawned ranks."""
    out = json.loads(evaluated["lines"][(name, ranks, tp, pp, cp)].strip().splitlines()[-1])
    ref = evaluated["refs"][name]
    assert out["tokens"] == 3 * SEQ
    assert abs(out["loss"] - ref) <= RTOL * abs(ref), (out, ref)
