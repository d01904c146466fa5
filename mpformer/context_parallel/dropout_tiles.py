"""Attention with dropout where no fused kernel takes it, a tile at a time: never an [s, s] matrix.

torch's fused attention kernels with a log-sum-exp take no dropout on CPU (SDPA falls back to its math
kernel, which forms the whole score matrix), nor on CUDA together with an arbitrary mask. This kernel
runs the attention plan's blocks (core/attention_plan.py) cut into tiles of at most TILE x TILE as two
matmuls and a softmax each, with dropout on the probabilities, and merges the tiles by log-sum-exp as
the fused path merges blocks. Dropout commutes with the merge: a tile's probabilities are the row's
times a positive factor, and the mask multiplies them elementwise. Each tile's mask is drawn from a
generator seeded by the call's seed (drawn from the caller's generator: the tp-rank stream under tensor
parallelism) and the tile's position, so the backward draws the same masks again and keeps none.

    forward (tile):   S = q kᵀ·scale (masked)   lse_t = logsumexp(S)   out_t = (exp(S - lse_t) ∘ M/(1-p)) v
    backward (tile):  P = exp(S - lse)   dv = (P ∘ M/(1-p))ᵀ dO   dP = (dO vᵀ) ∘ M/(1-p)
                      dS = P ∘ (dP - rowsum(dO ∘ O))   dq = dS k·scale   dk = dSᵀ q·scale

Shapes as blockwise.py: q ``[b, n, q, d]``, k and v ``[b, kv, s, d]`` (kv heads repeated per tile).
"""

from __future__ import annotations

import torch

from mpformer.context_parallel.fused import repeat_kv
from mpformer.core.attention_plan import CAUSAL, FULL, ScoreBlock

NEG_INF = float("-inf")


TILE = 512  # a tile's side: its scores, probabilities and dropout mask, per head, are the transient


def _tiles(block: ScoreBlock, window: int | None) -> list[ScoreBlock]:
    """``block`` cut into tiles of at most TILE x TILE (positions follow rows within a non-full block),
    the tiles nobody sees left out. A causal square's tiles below its diagonal see everything (full);
    a masked block's tiles keep its mask, and a row of one may see nothing (the kernel takes -inf rows)."""
    out = []
    for a in range(0, block.q_len, TILE):
        for c in range(0, block.k_len, TILE):
            qn, kn = min(TILE, block.q_len - a), min(TILE, block.k_len - c)
            t = ScoreBlock(block.q_row + a, block.k_row + c, qn, kn, block.q_pos + a, block.k_pos + c, block.kind)
            if t.kind == FULL:
                out.append(t)
                continue
            last_q, last_k = t.q_pos + qn - 1, t.k_pos + kn - 1
            if t.k_pos > last_q or (window is not None and t.q_pos - last_k >= window):
                continue  # every key after every query, or all beyond the window
            if t.kind == CAUSAL and c != a:  # below the diagonal (tiles are aligned): every key before
                t = ScoreBlock(t.q_row, t.k_row, qn, kn, t.q_pos, t.k_pos, FULL)
            out.append(t)
    return out


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf rows (no key seen yet) as 0, so exp(S - lse) is 0 there rather than nan."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _seen(t: ScoreBlock, window: int | None, device: torch.device) -> torch.Tensor | None:
    """The tile's mask of seen pairs (None: all seen). A full block's tiles see everything."""
    if t.kind == FULL:
        return None
    i = torch.arange(t.q_pos, t.q_pos + t.q_len, device=device)[:, None]
    j = torch.arange(t.k_pos, t.k_pos + t.k_len, device=device)[None, :]
    seen = j <= i
    if window is not None:
        seen = seen & (i - j < window)
    return seen


_M64 = 2**64 - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit integers that spreads every input bit."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _M64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _M64
    return x ^ (x >> 31)


def tile_seed(seed: int, q_pos: int, k_pos: int) -> int:
    """The generator seed of the tile at (q_pos, k_pos): each position chained through a bijection, so
    distinct tiles get distinct seeds at any length (``q * 65537 + k`` repeated once k passed 65536)."""
    return _mix(_mix(_mix(seed & _M64) ^ q_pos) ^ k_pos) % 2**63


def _keep(seed: int, t: ScoreBlock, shape: tuple[int, ...], p: float, device: torch.device) -> torch.Tensor:
    """The tile's dropout keep-mask scaled by 1/(1-p), the same on every call with this seed."""
    g = torch.Generator(device=device).manual_seed(tile_seed(seed, t.q_pos, t.k_pos))
    r = torch.rand(shape, generator=g, device=device)
    return r.ge_(p).div_(1.0 - p)  # in place: one tile-sized tensor


def _scores(q: torch.Tensor, k: torch.Tensor, seen: torch.Tensor | None, scale: float) -> torch.Tensor:
    s = torch.einsum("bnqd,bnsd->bnqs", q, k) * scale
    return s if seen is None else s.masked_fill(~seen, NEG_INF)


class DropoutTiles(torch.autograd.Function):
    """Attention of queries over keys by the plan's blocks, tile by tile, with attention dropout ``p``."""

    @staticmethod
    def forward(ctx, q, k, v, blocks, window, scale, p, seed):
        acc = torch.promote_types(q.dtype, torch.float32)
        qf, kf, vf = (repeat_kv(t, q.shape[1]).to(acc) for t in (q, k, v))
        out = torch.zeros(qf.shape, dtype=acc, device=q.device)
        lse = torch.full(qf.shape[:-1], NEG_INF, dtype=acc, device=q.device)
        for t in (x for b in blocks for x in _tiles(b, window)):
            qt, kt, vt = qf[:, :, t.q_rows], kf[:, :, t.k_rows], vf[:, :, t.k_rows]
            s = _scores(qt, kt, _seen(t, window, q.device), scale)
            lse_t = torch.logsumexp(s, -1)
            prob = s.sub_(_finite(lse_t).unsqueeze(-1)).exp_().mul_(_keep(seed, t, s.shape, p, q.device))
            out_t = torch.einsum("bnqs,bnsd->bnqd", prob, vt)
            del s, prob
            lse_a = lse[:, :, t.q_rows]
            new = torch.logaddexp(lse_a, lse_t)
            safe = _finite(new)
            out[:, :, t.q_rows] = (out[:, :, t.q_rows] * torch.exp(lse_a - safe).unsqueeze(-1)
                                   + out_t * torch.exp(lse_t - safe).unsqueeze(-1))
            lse[:, :, t.q_rows] = new
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.meta = (blocks, window, scale, p, seed)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        blocks, window, scale, p, seed = ctx.meta
        acc, n = out.dtype, q.shape[1]
        qf, kf, vf = (repeat_kv(t, n).to(acc) for t in (q, k, v))
        do = dout.to(acc)
        delta = (do * out).sum(-1)
        dq, dk, dv = torch.zeros_like(qf), torch.zeros_like(kf), torch.zeros_like(vf)
        lse = _finite(lse)
        for t in (x for b in blocks for x in _tiles(b, window)):
            qr, kr = t.q_rows, t.k_rows
            prob = _scores(qf[:, :, qr], kf[:, :, kr], _seen(t, window, q.device), scale)
            prob.sub_(lse[:, :, qr].unsqueeze(-1)).exp_()
            keep = _keep(seed, t, prob.shape, p, q.device)
            dv[:, :, kr] += torch.einsum("bnqs,bnqd->bnsd", prob * keep, do[:, :, qr])
            dp = torch.einsum("bnqd,bnsd->bnqs", do[:, :, qr], vf[:, :, kr]).mul_(keep)
            del keep
            ds = dp.sub_(delta[:, :, qr].unsqueeze(-1)).mul_(prob)
            del prob
            dq[:, :, qr] += torch.einsum("bnqs,bnsd->bnqd", ds, kf[:, :, kr]) * scale
            dk[:, :, kr] += torch.einsum("bnqs,bnqd->bnsd", ds, qf[:, :, qr]) * scale
        g = n // k.shape[1]
        if g > 1:  # the repeated heads' gradients back onto their kv head
            dk, dv = (x.unflatten(1, (k.shape[1], g)).sum(2) for x in (dk, dv))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def dropout_attention(q_bnsd: torch.Tensor, k_bksd: torch.Tensor, v_bksd: torch.Tensor, blocks: tuple[ScoreBlock, ...],
                      window: int | None, scale: float, p: float) -> torch.Tensor:
    """The plan ``blocks`` (one batch-row group's) with attention dropout ``p``, tile by tile."""
    # From the caller's generator on the queries' device (the tp-rank stream; a selective recompute
    # restores it); on CUDA the one host sync of this path, which runs only where nothing fused can.
    seed = int(torch.randint(0, 2**62, (1,), device=q_bnsd.device).item())
    return DropoutTiles.apply(q_bnsd, k_bksd, v_bksd, blocks, window, scale, p, seed)

