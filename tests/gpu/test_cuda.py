"""The CUDA path, run where a GPU is visible (benchmarks/gpu_check.sh runs these; CI skips them).

    HF parity on cuda     transformers' LlamaForCausalLM and mpformer with the same weights, fp32 with
                          TF32 off: logits and loss within rtol/atol 1e-4 (GPU attention kernels sum
                          in another order than the CPU's; 1e-5 is the CPU tests' bound)
    cuda against cpu      the same model, loss and every gradient, rtol/atol 1e-4
    attention backend     bf16 SDPA as the model calls it runs under FLASH_ATTENTION alone
    bf16 training         the pretrain CLI on one GPU: the loss falls, the peak memory is reported
    bit-exact resume      train.deterministic=true: 2 + 2 steps resumed equal 4 steps, bit for bit
    loader, stopwatch     batches pinned and copied without blocking; stream events, not syncs
    activation offload    side-stream copies out and back: the same gradients bit for bit, memory freed
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (gpu_check.sh)")]

from mpformer.core.model_config import ModelConfig  # noqa: E402
from mpformer.models import Transformer  # noqa: E402
from mpformer.testing.cli import run_cli  # noqa: E402

TOL = {"rtol": 1e-4, "atol": 1e-4}
CFG = ModelConfig(arch="llama", num_layers=2, hidden_size=128, num_attention_heads=4, num_kv_heads=2,
                  ffn_hidden_size=256, vocab_size=512, max_position_embeddings=256)


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def _tokens(b: int = 2, s: int = 64) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (b, s + 1), generator=torch.Generator().manual_seed(0))


def test_hf_llama_parity_on_cuda():
    from transformers import LlamaConfig, LlamaForCausalLM

    from mpformer.convert import adapter_for_arch

    adapter = adapter_for_arch("llama")
    hf_dict, _ = adapter.config_to_hf(CFG)
    hf_dict.pop("model_type")
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**hf_dict, use_cache=False)).float().cuda().eval()
    mp = Transformer(CFG, seed=None, device="cuda").eval()
    canonical = adapter.to_canonical({k: v.cpu() for k, v in hf.state_dict().items()}, CFG)
    with torch.no_grad():
        for name, t in mp.canonical_tensors().items():
            t.copy_(canonical[name])
    data = _tokens().cuda()
    inputs, labels = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    with torch.no_grad():
        ref = hf(input_ids=inputs, labels=labels, shift_labels=labels)
        torch.testing.assert_close(mp(inputs), ref.logits, **TOL)
        torch.testing.assert_close(mp(inputs, labels), ref.loss, **TOL)


def test_cuda_matches_cpu_loss_and_gradients():
    data = _tokens()
    grads = {}
    for dev in ("cpu", "cuda"):
        model = Transformer(CFG, seed=7, device=dev)
        d = data.to(dev)
        loss = model(d[:, :-1], d[:, 1:])
        loss.backward()
        grads[dev] = (loss.detach().cpu(), {n: p.grad.cpu() for n, p in model.named_parameters()})
    torch.testing.assert_close(grads["cuda"][0], grads["cpu"][0], **TOL)
    for name, g in grads["cpu"][1].items():
        torch.testing.assert_close(grads["cuda"][1][name], g, **TOL, msg=lambda m, n=name: f"{n}: {m}")


def test_bf16_attention_runs_on_flash():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = Transformer(CFG, seed=7, device="cuda")
    data = _tokens().cuda()
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(data[:, :-1], data[:, 1:])  # raises if the call's shape or flags rule flash out
    loss.backward()
    assert torch.isfinite(loss)


def _train(tmp: Path, tiny_data: str, name: str, *extra: str) -> list[dict]:
    run_dir = tmp / name
    res = run_cli(["pretrain/pretrain_gpt.py", "model=tiny-llama", f"data.paths=[{tiny_data}]", "train.seq_length=64",
                   "train.global_batch_size=8", "train.micro_batch_size=4", "train.device=cuda",
                   "train.precision=bf16", "logging.progress=false", f"hydra.run.dir={run_dir}", *extra],
                  torchrun=1, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_bf16_training_on_one_gpu(tiny_data, tmp_path):
    rows = _train(tmp_path, tiny_data, "run", "train.steps=30", "optim.lr=3e-3")
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert all(r["mem_peak_bytes"] > 0 for r in rows)


def test_deterministic_resume_is_bit_exact_on_cuda(tiny_data, tmp_path):
    det = ("train.deterministic=true", "train.steps=4", "model.hidden_dropout=0.1")
    full = _train(tmp_path, tiny_data, "full", *det)
    _train(tmp_path, tiny_data, "first", *det, "train.stop_at=2")
    second = _train(tmp_path, tiny_data, "second", *det, f"checkpoint.load={tmp_path / 'first' / 'checkpoints'}")
    assert [r["loss"] for r in second] == [r["loss"] for r in full[2:]]
    assert [r["grad_norm"] for r in second] == [r["grad_norm"] for r in full[2:]]


def test_loader_pins_and_stopwatch_uses_events():
    from mpformer.data.loader import StepLoader
    from mpformer.parallel.device import Device, Stopwatch

    seen: list[bool] = []

    def read(p: int) -> list[torch.Tensor]:
        return [torch.full((4, 65), p, dtype=torch.long)]

    loader = StepLoader(read, stride=4, device=torch.device("cuda", torch.cuda.current_device()), depth=2)
    for p in (0, 4, 8):
        (batch,) = loader.take(p)
        seen.append(batch.is_cuda and int(batch[0, 0]) == p)
    loader.close()
    assert all(seen)
    assert loader._prepare(0)[0].is_pinned()

    watch = Stopwatch(Device("cuda", torch.cuda.current_device()))
    a = watch.mark()
    x = torch.randn(2048, 2048, device="cuda")
    for _ in range(20):
        x = x @ x / 2048
    b = watch.mark()
    assert isinstance(a, torch.cuda.Event)
    assert watch.seconds(b) > watch.seconds(a)


def test_one_visible_gpu_per_process():
    from mpformer.parallel.device import resolve_device

    visible = torch.cuda.device_count()
    env_rank = os.environ.get("LOCAL_RANK")
    try:
        os.environ["LOCAL_WORLD_SIZE"] = str(visible + 3)
        dev = resolve_device("cuda", local_rank=visible + 2) if visible == 1 else resolve_device("cuda", local_rank=0)
        assert dev.kind == "cuda" and dev.index == 0
    finally:
        os.environ.pop("LOCAL_WORLD_SIZE", None)
        if env_rank is not None:
            os.environ["LOCAL_RANK"] = env_rank


def test_activation_offload_on_cuda_comes_back_bit_for_bit():
    """HostCopies on CUDA (side streams, pinned host buffers, events): a model's saved activations copied
    out during its forward and prefetched back before its backward give the same gradients, bit for
    bit, as without; the copies overlap (no synchronise in pack or unpack) and the device memory the
    moved tensors held goes back to the allocator."""
    import copy

    from mpformer.parallel.device import Device, HostCopies
    from mpformer.pipeline.offload import ActivationOffload

    torch.manual_seed(0)
    model = Transformer(CFG, device="cuda").train()
    ref = copy.deepcopy(model)
    tokens = torch.randint(0, 512, (4, 128), device="cuda")
    labels = torch.randint(0, 512, (4, 128), device="cuda")
    ref(tokens, labels).backward()
    off = ActivationOffload(HostCopies(Device("cuda")), model, {(0, 0)}, min_bytes=0)  # this model's are small
    off.start()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with off.saving((0, 0)):
        loss = model(tokens, labels)
    torch.cuda.synchronize()
    torch.empty(1, device="cuda")  # an allocation lets the allocator take back blocks whose copies are done
    kept = torch.cuda.memory_allocated() - before
    assert off.moved_bytes > 0 and kept < off.moved_bytes / 2, (kept, off.moved_bytes)
    off.prefetch((0, 0))
    loss.backward()
    off.done((0, 0))
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)
