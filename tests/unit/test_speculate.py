"""optim/speculate.py: a speculative optimizer step undone leaves the parameters and the optimizer's
state exactly as they were, the first step's state included (torch.optim.AdamW as the oracle: the undone
and redone run equals a run that never speculated, bit for bit)."""

from __future__ import annotations

import torch

from mpformer.optim.speculate import Speculation


def _run(speculate_every_step: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(5, 3))
    opt = torch.optim.AdamW([w], lr=1e-2, weight_decay=0.1)
    for step in range(4):
        w.grad = torch.randn(5, 3) * (step + 1)
        if speculate_every_step:
            spec = Speculation.take(opt)
            opt.step()  # speculative, on the unscaled gradient
            spec.restore(opt)  # the check said: clip
        w.grad.mul_(0.5)
        opt.step()
    return [w.detach().clone(), opt.state[w]["exp_avg"].clone(), opt.state[w]["exp_avg_sq"].clone(),
            opt.state[w]["step"].clone()]


def test_an_undone_step_leaves_nothing_behind():
    assert all(torch.equal(a, b) for a, b in zip(_run(True), _run(False)))


def test_the_first_step_state_is_dropped():
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([w], lr=0.1)
    w.grad = torch.ones(2)
    spec = Speculation.take(opt)
    opt.step()
    assert w in opt.state
    spec.restore(opt)
    assert w not in opt.state and torch.equal(w.detach(), torch.ones(2))
