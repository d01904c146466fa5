"""Mixture of experts on the device: what no CPU test reaches (gpu_check.sh runs these; CI skips them).

    grouped GEMM       torch._grouped_mm (the CUTLASS kernel on sm90, bf16) forward and backward against the
                       per-expert loop on the same device, experts with no tokens among them: output and the
                       gradients of x, w_up, w_down within 2e-2 of the largest element (bf16 keeps 8 bits:
                       2^-8 = 3.9e-3 per rounding, and the two paths round the [N, 2f] and [N, f]
                       intermediates after sums taken in another order: a few ulps of the largest); an
                       empty expert's weight gradients exactly zero, also with the counts on the device
    choose_method      grouped for aligned bf16 on CUDA, the loop for fp32 or misaligned sizes
    layer cuda = cpu   a mixtral-tiny MoE layer (h 64, 8 experts, top 2, aux loss on), fp32 with TF32 off:
                       the same routing, output, input and parameter gradients within 1e-5 of the largest
                       element (the GEMMs sum in another order: ~1e-7 seen for sums of 64 terms)
    layer bf16         the same layer in bf16 takes the grouped GEMM, and equals its loop within 2e-2
    one host read      a training forward reads the device once (the dispatch's counts: host_ints), under
                       torch.cuda.set_sync_debug_mode("warn") counting every synchronising call; its
                       backward none

``MPFORMER_GPU_DRY_RUN=1`` (gpu_check.sh --dry-run) runs them on the CPU instead (the host reads counted
by HostSyncs there): a typo cannot cost GPU minutes. Without either they are skipped.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch

DRY = os.environ.get("MPFORMER_GPU_DRY_RUN") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(DEVICE != "cuda" and not DRY,
                                                  reason="needs a CUDA device (gpu_check.sh; --dry-run on CPU)")]

import yaml  # noqa: E402

from mpformer.core.model_config import ModelConfig  # noqa: E402
from mpformer.layers import moe as moe_mod  # noqa: E402
from mpformer.layers import moe_dispatch  # noqa: E402
from mpformer.layers.expert_gemm import choose_method, expert_mlp, grouped_ok  # noqa: E402
from mpformer.layers.moe import MoE  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BF16_TOL = 2e-2  # of the largest element: a few bf16 ulps (2^-8 relative) through two GEMMs and SwiGLU
FP32_TOL = 1e-5  # of the largest element, TF32 off
# uneven counts with empty experts (first, middle, last), one expert holding most rows
COUNTS = {"uneven": [0, 37, 5, 0, 120, 1, 64, 0], "one expert": [0, 0, 0, 250, 0, 0, 0, 0]}


@pytest.fixture(autouse=True)
def _no_tf32():
    if DEVICE != "cuda":
        yield
        return
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| over max |want|."""
    got, want = got.detach().float(), want.detach().float()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def _gemm_inputs(counts: list[int], h: int = 256, f: int = 512, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n, E = sum(counts), len(counts)
    x = torch.randn(n, h, generator=g)
    w_up = torch.randn(E, 2 * f, h, generator=g) / h**0.5
    w_down = torch.randn(E, h, f, generator=g) / f**0.5
    dy = torch.randn(n, h, generator=g)
    return [t.to(DEVICE, torch.bfloat16) for t in (x, w_up, w_down, dy)]


def _run(method: str, counts, x, w_up, w_down, dy):
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, w_up, w_down)]
    y = expert_mlp(leaves[0], counts, leaves[1], leaves[2], method=method)
    y.backward(dy)
    return [y] + [t.grad for t in leaves]


@pytest.mark.parametrize("case", sorted(COUNTS))
def test_grouped_gemm_equals_the_loop_in_bf16(case):
    counts = COUNTS[case]
    assert grouped_ok(DEVICE, torch.bfloat16, 256, 512)
    args = _gemm_inputs(counts)
    want = _run("loop", counts, *args)
    got = _run("grouped", counts, *args)
    errors = {name: _err(a, b) for name, a, b in zip(("y", "dx", "dw_up", "dw_down"), got, want)}
    assert max(errors.values()) <= BF16_TOL, errors
    for e, c in enumerate(counts):
        if c == 0:  # no rows, no gradient: exactly zero, whatever the kernel leaves for an empty group
            assert not got[2][e].any() and not got[3][e].any(), (case, e)


def test_grouped_gemm_with_counts_on_the_device():
    """The counts as a device tensor (no host list, so no host knowledge of which experts are empty): the
    same result as from the list, empty experts' gradients zero by the kernel alone."""
    counts = COUNTS["uneven"]
    args = _gemm_inputs(counts, seed=1)
    want = _run("grouped", counts, *args)
    got = _run("grouped", torch.tensor(counts, device=DEVICE), *args)
    errors = {name: _err(a, b) for name, a, b in zip(("y", "dx", "dw_up", "dw_down"), got, want)}
    assert max(errors.values()) <= BF16_TOL, errors
    empty = [e for e, c in enumerate(counts) if c == 0]
    assert not got[2][empty].any() and not got[3][empty].any(), "an empty group's dW is not zero"


def test_choose_method_takes_grouped_for_aligned_bf16_on_cuda():
    assert choose_method("cuda", torch.bfloat16, 4096, 14336) == "grouped"  # Mixtral 8x7B
    assert choose_method("cuda", torch.bfloat16, 2048, 768) == "grouped"  # Qwen3-30B-A3B
    assert choose_method("cuda", torch.float32, 4096, 14336) == "loop"  # the CUDA kernel is bf16 only
    assert choose_method("cuda", torch.bfloat16, 4100, 14336) == "loop"  # rows not 16-byte aligned
    assert choose_method("cpu", torch.bfloat16, 4096, 14336) == "loop"


def _layer(dtype: torch.dtype, device: str, seed: int = 3) -> MoE:
    cfg = ModelConfig(**yaml.safe_load((ROOT / "configs" / "model" / "mixtral-tiny.yaml").read_text())).validate()
    torch.manual_seed(seed)
    layer = MoE(cfg).train()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return layer.to(device=device, dtype=dtype)


def _inputs(h: int, dtype: torch.dtype, device: str, seed: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x, dy = torch.randn(32, 2, h, generator=g), torch.randn(32, 2, h, generator=g)
    return x.to(device, dtype).requires_grad_(True), dy.to(device, dtype)


def _forward_backward(layer: MoE, x: torch.Tensor, dy: torch.Tensor) -> dict[str, torch.Tensor]:
    experts = layer.router(x.detach().reshape(-1, x.shape[-1]))[1]
    y = layer(x)
    y.backward(dy)
    stats = layer.take_stats()
    return {"experts": experts, "y": y, "dx": x.grad, "load": stats.load, "aux": stats.aux,
            **{f"d{n}": p.grad for n, p in layer.named_parameters()}}


def test_moe_layer_on_cuda_equals_cpu_in_fp32():
    cpu = _forward_backward(_layer(torch.float32, "cpu"), *_inputs(64, torch.float32, "cpu"))
    dev = _forward_backward(_layer(torch.float32, DEVICE), *_inputs(64, torch.float32, DEVICE))
    # the same top-k first: a flipped near-tie would show as a large error below, not a numerical one
    assert torch.equal(dev["experts"].cpu(), cpu["experts"]), "the routing differs between cuda and cpu"
    assert torch.equal(dev["load"].cpu(), cpu["load"])
    errors = {k: _err(dev[k].cpu(), cpu[k]) for k in cpu if k not in ("experts", "load")}
    assert max(errors.values()) <= FP32_TOL, errors


def test_moe_layer_in_bf16_takes_the_grouped_gemm_and_equals_its_loop(monkeypatch):
    calls = []
    real = torch._grouped_mm

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_grouped_mm", counting)
    if DEVICE != "cuda":  # the dry run: the CPU's default is the loop; its _grouped_mm runs the same calls
        monkeypatch.setattr(moe_mod, "choose_method", lambda *a: "grouped")
    got = _forward_backward(_layer(torch.bfloat16, DEVICE), *_inputs(64, torch.bfloat16, DEVICE))
    assert len(calls) == 2 + 4, len(calls)  # up and down forward; dX and dW of each backward
    monkeypatch.setattr(moe_mod, "choose_method", lambda *a: "loop")
    want = _forward_backward(_layer(torch.bfloat16, DEVICE), *_inputs(64, torch.bfloat16, DEVICE))
    assert torch.equal(got["experts"], want["experts"])  # the same router, the same bf16 inputs
    errors = {k: _err(got[k], want[k]) for k in want if k not in ("experts", "load")}
    assert max(errors.values()) <= BF16_TOL, errors


class _Syncs:
    """Every synchronising CUDA call inside (torch.cuda.set_sync_debug_mode("warn"): one warning each, where
    in Python it was made), or on CPU the ops that read device values (HostSyncs)."""

    def __enter__(self) -> _Syncs:
        self.where: list[str] = []
        if DEVICE == "cuda":
            torch.cuda.synchronize()
            self._warnings = warnings.catch_warnings(record=True)
            self._log = self._warnings.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        else:
            from mpformer.parallel.host_syncs import HostSyncs

            self._mode = HostSyncs().__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if DEVICE == "cuda":
            torch.cuda.set_sync_debug_mode("default")
            self._warnings.__exit__(*exc)
            self.where = [f"{Path(w.filename).name}:{w.lineno}" for w in self._log
                          if "synchronizing" in str(w.message)]
        else:
            self._mode.__exit__(*exc)
            self.where = list(self._mode.ops)


def _counting_host_reads(monkeypatch) -> list[int]:
    reads: list[int] = []
    real = moe_dispatch.host_ints

    def counted(t, stand_in):
        reads.append(t.numel())
        return real(t, stand_in)

    monkeypatch.setattr(moe_dispatch, "host_ints", counted)
    return reads


def test_a_training_forward_reads_the_device_once(monkeypatch):
    """The production path (bf16, grouped GEMM, aux loss, statistics): the dispatch's one read of the counts,
    no other synchronising call (pageable copies to the device included)."""
    layer = _layer(torch.bfloat16, DEVICE)
    x, dy = _inputs(64, torch.bfloat16, DEVICE)
    layer(x).backward(dy)  # warm: the allocators' first blocks, cuBLAS's handle
    assert choose_method("cuda", torch.bfloat16, 64, 32) == "grouped"  # what the layer takes on CUDA
    reads = _counting_host_reads(monkeypatch)
    with _Syncs() as syncs:
        layer(x)
    assert len(reads) == 1, reads  # the counts, the dropped and the bad ids: one tensor
    if DEVICE == "cuda":
        assert len(syncs.where) == 1, (torch.cuda.get_device_capability(), syncs.where)
    else:
        assert syncs.where == [], syncs.where  # tolist is no dispatched op on CPU: nothing else may read


def test_a_training_backward_never_waits_for_the_device():
    layer = _layer(torch.bfloat16, DEVICE)
    x, dy = _inputs(64, torch.bfloat16, DEVICE)
    layer(x).backward(dy)  # warm
    x.grad = None
    y = layer(x)
    with _Syncs() as syncs:
        y.backward(dy)
    assert syncs.where == [], (torch.cuda.get_device_capability() if DEVICE == "cuda" else "cpu", syncs.where)


def test_grouped_gemm_itself_never_waits_for_the_device():
    """The grouped GEMM with host counts (the layer's call): offsets staged through pinned memory, empty
    experts zeroed by view; forward and backward without a synchronising call."""
    counts = COUNTS["uneven"]
    x, w_up, w_down, dy = _gemm_inputs(counts, seed=2)
    _run("grouped", counts, x, w_up, w_down, dy)  # warm
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, w_up, w_down)]
    with _Syncs() as syncs:
        expert_mlp(leaves[0], counts, leaves[1], leaves[2], method="grouped").backward(dy)
    assert syncs.where == [], syncs.where
