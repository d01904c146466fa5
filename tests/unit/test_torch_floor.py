"""pyproject's torch floor is the oldest torch the code runs on: every aten op the code calls directly is
in that release, or has a fallback that runs without it (and gives the same results).

Oracle for the releases: the op's first release in torch's own history (its native_functions.yaml entry,
the pull request named below). An op the table does not know fails the test until it is added.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SINCE = {  # aten op -> the first torch release that has it
    "_fused_rms_norm": (2, 8),  # pytorch PR 153666 (2025)
    "_scaled_dot_product_flash_attention_for_cpu": (2, 2),
    "_scaled_dot_product_flash_attention_for_cpu_backward": (2, 2),
    "_scaled_dot_product_flash_attention": (2, 0),
    "_scaled_dot_product_flash_attention_backward": (2, 0),
    "_scaled_dot_product_efficient_attention": (2, 0),
    "_scaled_dot_product_efficient_attention_backward": (2, 0),
    "_local_scalar_dense": (1, 0), "nonzero": (1, 0), "masked_select": (1, 0), "_unique2": (1, 0),
    "unique_consecutive": (1, 0), "repeat_interleave": (1, 0), "index": (1, 0), "index_put": (1, 0),
    "index_put_": (1, 0), "_to_copy": (2, 0),  # older than 2.0; no earlier release is claimed here
    "_grouped_mm": (2, 8),  # torch.nn.functional.grouped_mm's kernel, first in 2.8's native_functions.yaml
}
# layers/norm.py computes _fused_rms_norm from plain ops where torch lacks it; without _grouped_mm the
# experts run the per-expert loop (layers/expert_gemm.py grouped_ok) and a rehearsal counts no such call
FALLBACKS = {"_fused_rms_norm", "_grouped_mm"}


def _floor() -> tuple[int, int]:
    text = (ROOT / "pyproject.toml").read_text()
    major, minor = re.search(r'"torch>=(\d+)\.(\d+)', text).groups()
    return int(major), int(minor)


def _ops_called() -> set[str]:
    found = set()
    for path in (ROOT / "mpformer").rglob("*.py"):
        found |= set(re.findall(r"(?:_aten|torch\.ops\.aten)\.([a-z_0-9]+)", path.read_text()))
    return found


def test_every_aten_op_is_in_the_floor_release_or_has_a_fallback():
    floor = _floor()
    ops = _ops_called()
    unknown = sorted(ops - set(SINCE))
    assert not unknown, f"aten ops called but not in this test's table (add their first release): {unknown}"
    newer = sorted(op for op in ops if SINCE[op] > floor and op not in FALLBACKS)
    assert not newer, f"ops newer than the floor torch>={floor[0]}.{floor[1]} without a fallback: {newer}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_rms_norm_fallback_gives_the_fused_kernels_results(dtype):
    from mpformer.layers.norm import rms_norm_stats

    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, 64, generator=gen) * 3).to(dtype)
    w = torch.randn(64, generator=gen).to(dtype)
    for weight in (None, w):
        out, rstd = rms_norm_stats(x, weight, 1e-5, fused=True)
        out2, rstd2 = rms_norm_stats(x, weight, 1e-5, fused=False)
        torch.testing.assert_close(rstd2, rstd, rtol=1e-6, atol=0)  # fp32 statistics either way
        # the output rounds once to the dtype (bf16: within one unit in the last place)
        tol = {torch.float32: 1e-6, torch.bfloat16: 2 ** -7}[dtype]
        torch.testing.assert_close(out2.float(), out.float(), rtol=tol, atol=tol)
