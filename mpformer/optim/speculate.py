"""Optimizer post-validation (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", section 4).

The synchronous step waits for the global gradient norm (clipping) and the global inf/NaN check,
collectives over every pipeline stage, before any stage may update its weights: a stage whose
gradients were final long before the last stage's (1F1B's last ranks, any zero-bubble schedule's
first) idles until then. With ``train.post_validation=true`` a rank steps its optimizer as soon as its
own gradients are final, speculating that the step needs no clipping and is not to be skipped, and
only then joins the norm's all-reduce; when the completed check says otherwise, the speculation is
undone exactly (the state it changed was saved before it) and the step is redone clipped, or not at
all. Equal to the synchronous step bit for bit in every case (tests/distributed/test_pipeline.py).

What is saved: every parameter the wrapped optimizer steps (the fp32 masters, or the parameters
themselves in fp32) and every tensor of its state (Adam's moments and step counts): at most one more
copy of the optimizer's share of the model state for the length of the step. The 16-bit parameters and
the ZeRO-1/2 parameter gather are written from the masters after the check, never speculatively,
except under ``train.overlap_validation``: there the next step runs on the speculative parameters
while the check is in flight (training/overlap.py), the gradient shards are kept as well (one more
copy), and a failed check runs that step again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Speculation:
    """The optimizer's parameters and state as they were before a speculative step."""

    params: list[tuple[torch.Tensor, torch.Tensor]]  # (parameter, its saved data)
    state: dict[int, dict]  # id(parameter) -> its optimizer state before (absent: none yet)
    grads: list[torch.Tensor] | None = None  # copies of the step's gradient shards (overlap_validation)

    @classmethod
    def take(cls, optimizer: torch.optim.Optimizer, grads: list[torch.Tensor] | None = None) -> Speculation:
        params, state = [], {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                params.append((p, p.detach().clone()))
                if p in optimizer.state:
                    state[id(p)] = {k: v.clone() if torch.is_tensor(v) else v
                                    for k, v in optimizer.state[p].items()}
        return cls(params, state, [g.clone() for g in grads] if grads is not None else None)

    def restore(self, optimizer: torch.optim.Optimizer) -> None:
        """Parameters and state exactly as they were; state the step created is dropped."""
        for p, saved in self.params:
            p.data.copy_(saved)
            before = self.state.get(id(p))
            if before is None:
                optimizer.state.pop(p, None)
                continue
            now = optimizer.state[p]
            for k, v in before.items():
                if torch.is_tensor(v):
                    now[k].copy_(v)
                else:
                    now[k] = v
