"""Model-state memory per rank, counted from the tensors actually held, against ZeRO's formulas.

``model_state_bytes`` walks the tensors a distributed optimizer keeps (parameter storage, gradient
buffers, fp32 master copies, the wrapped optimizer's state) and sums each distinct storage once,
so views into flat buffers are not double counted. ``zero_formula_bytes`` is docs/formulas.md's table
generalised to the dtypes in use: weights ``w`` bytes, gradients ``g``, master copies ``m`` (0 when
the weights are already fp32 and serve as masters), optimizer state ``k`` bytes per parameter.

    stage 0   (w + g + m + k) Psi          stage 2   w Psi + (g + m + k) Psi / N_d
    stage 1   (w + g) Psi + (m + k) Psi / N_d   stage 3   (w + g + m + k) Psi / N_d
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch


def _bytes(tensors: Iterable[torch.Tensor | None], seen: set[int]) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        st = t.untyped_storage()
        if st._cdata in seen or st.nbytes() == 0:  # the StorageImpl: distinct on meta too (addresses are 0)
            continue
        seen.add(st._cdata)
        total += st.nbytes()
    return total


def model_state_bytes(weights: Iterable[torch.Tensor], grads: Iterable[torch.Tensor | None],
                      masters: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of distinct storages by kind; ``optimizer_scalars`` are per-tensor step counters."""
    from mpformer.checkpoint.io import init_optimizer_state

    init_optimizer_state(optimizer)  # the zeros the first step creates: count them before it runs
    seen: set[int] = set()
    out = {"weights": _bytes(weights, seen), "gradients": _bytes(grads, seen), "master_weights": _bytes(masters, seen)}
    state = [t for st in optimizer.state.values() for t in st.values() if torch.is_tensor(t)]
    out["optimizer_state"] = _bytes((t for t in state if t.dim() > 0), seen)
    out["optimizer_scalars"] = _bytes((t for t in state if t.dim() == 0), seen)
    out["total"] = sum(out.values())
    return out


def zero_formula_bytes(stage: int, psi: int, dp: int, *, w: int, g: int, m: int, k: int) -> float:
    """docs/formulas.md's model-state bytes per device for ZeRO ``stage`` with these bytes per parameter."""
    if stage == 0:
        return (w + g + m + k) * psi
    if stage == 1:
        return (w + g) * psi + (m + k) * psi / dp
    if stage == 2:
        return w * psi + (g + m + k) * psi / dp
    if stage == 3:
        return (w + g + m + k) * psi / dp
    raise ValueError(f"ZeRO stage {stage}")


def format_report(rank: int, mem: dict[str, int]) -> str:
    parts = ", ".join(f"{k.replace('_', ' ')} {v / 2**20:.2f} MiB" for k, v in mem.items() if k != "total")
    return f"model-state memory on rank {rank}: {mem['total'] / 2**20:.2f} MiB ({parts})"


def write_report(path: Path, per_rank: list[dict[str, int]], meta: dict) -> None:
    path.write_text(json.dumps({**meta, "per_rank": per_rank}, indent=1))
