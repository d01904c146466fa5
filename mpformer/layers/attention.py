"""Causal self-attention with grouped-query heads, RoPE and torch's SDPA core.

Shape legend (suffixes on tensor names):
    s  sequence length        b  micro-batch size        h  hidden size
    n  query heads            k  key/value heads          d  head dim
Activations between layers are sequence-first ``[s, b, h]`` (Megatron's order: sequence-parallel
scatter/gather later works on dim 0, which gloo/NCCL collectives concatenate along).
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from mpformer.context_parallel.blockwise import local_attention, row_plans
from mpformer.context_parallel.context import CPContext, SeqShard, compute_dtype
from mpformer.context_parallel.context import attention as cp_attention
from mpformer.context_parallel.dropout_tiles import dropout_attention
from mpformer.context_parallel.fused import causal_attention
from mpformer.core import attention_plan
from mpformer.core.layer_spec import DEFAULT_LINEAR, LinearKind, resolve
from mpformer.core.model_config import ModelConfig
from mpformer.core.sequence import Segment
from mpformer.core.shards import Shard
from mpformer.layers.linear import WeightGradStore
from mpformer.layers.norm import RMSNorm, SplitRMSNorm
from mpformer.layers.parallel import fused_shards, param_shards
from mpformer.parallel.device import DeviceLike, kernel_device, recompute_contexts
from mpformer.parallel.tensor_parallel import GradSpec, Part, TPContext


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [r/2] as HF computes them (r = cfg.rotary_dim: d, or the rotated part of a
    head under partial rotary), with Llama 3 scaling when configured."""
    d = cfg.rotary_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if cfg.rope_scaling_factor is None:
        return inv
    factor, lo, hi = cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    old_len = cfg.rope_original_max_position
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / lo, inv / factor, inv)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / hi) & ~(wavelen > old_len / lo)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables in HF's "rotate half" convention, so HF Llama q/k weights need no permutation."""

    def __init__(self, cfg: ModelConfig, device: DeviceLike = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.register_buffer("inv_freq", rope_inv_freq(cfg).to(device), persistent=False)

    def reset_buffers(self, device: DeviceLike) -> None:
        """The table computed again on ``device`` (a model built on the meta device, then materialised)."""
        self.inv_freq = rope_inv_freq(self.cfg).to(device)

    def forward(self, seq_len: int, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        return self.at(torch.arange(offset, offset + seq_len, device=self.inv_freq.device))

    def at(self, pos_s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables at global positions ``pos_s`` (a context-parallel rank's chunks)."""
        freqs_sd = torch.outer(pos_s.to(self.inv_freq.device, torch.float32), self.inv_freq.float())
        emb_sd = torch.cat((freqs_sd, freqs_sd), dim=-1)
        return emb_sd.cos(), emb_sd.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x_bnsd: torch.Tensor, cos_sd: torch.Tensor, sin_sd: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first r = cos_sd.shape[-1] dims of each head; the other d - r pass
    through (partial rotary, HF GLM's order: rotated part first)."""
    cos, sin = cos_sd.to(x_bnsd.dtype), sin_sd.to(x_bnsd.dtype)
    r = cos.shape[-1]
    if r == x_bnsd.shape[-1]:
        return x_bnsd * cos + _rotate_half(x_bnsd) * sin
    rot, keep = x_bnsd[..., :r], x_bnsd[..., r:]
    return torch.cat((rot * cos + _rotate_half(rot) * sin, keep), dim=-1)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw) -> torch.Tensor:
    """torch's SDPA on CPU (its flash kernel; math with dropout), with contiguous inputs (the kernel runs
    ~1.4x slower on the permuted views of the qkv projection: 30 against 21 ms fwd+bwd at b4 n8/4 s256
    d32) and 16-bit cores in the run's kernel choice's dtype (context.compute_dtype: fp32 where the probe
    found that faster). A GPU never calls it: its kernels are chosen by fused.attention_kernel."""
    assert kernel_device(q) == "cpu", "CUDA attention runs fused.causal_attention or the plan's blocks"
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    dtype = compute_dtype(q)
    if dtype != q.dtype:
        with torch.autocast("cpu", enabled=False):  # autocast would cast the fp32 inputs straight back
            return F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), **kw).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, **kw)


def attention_core(q_bnsd: torch.Tensor, k_bksd: torch.Tensor, v_bksd: torch.Tensor, *,
                   dropout_p: float, sliding_window: int | None, seq: SeqShard | None = None) -> torch.Tensor:
    """Causal attention without context parallelism; kv heads are shared by groups of n/k query heads
    (GQA, no copies). The whole sequence in order, the window (if any) not shorter than it: one fused
    kernel (CUDA: fused.causal_attention, the kernel fused.attention_kernel picks; CPU: torch's SDPA).
    Otherwise (documents, a window that cuts, a token slice's queries after its past keys) the blocks
    of the attention plan on the fused kernel with its log-sum-exp (blockwise.py). Attention dropout:
    CUDA's fused kernels take it, on either path; on a CPU, whose flash kernel does not, SDPA's math
    kernel for at most a tile of scores, else the plan's blocks a tile at a time (dropout_tiles.py). No
    path forms an [s, s] mask or score matrix."""
    s_q, s_k = q_bnsd.shape[2], k_bksd.shape[2]
    gqa = q_bnsd.shape[1] != k_bksd.shape[1]
    q_segments = seq.segments if seq is not None else (Segment(0, s_q),)
    k_segments = seq.key_segments if seq is not None else (Segment(0, s_k),)
    doc_starts = seq.doc_starts if seq is not None else None
    plain = doc_starts is None and s_q == s_k and (sliding_window is None or s_k <= sliding_window)
    scale = q_bnsd.shape[-1] ** -0.5
    if kernel_device(q_bnsd) == "cuda":
        if plain:
            return causal_attention(q_bnsd, k_bksd, v_bksd, dropout=dropout_p, scale=scale)
        return local_attention(q_bnsd, k_bksd, v_bksd, q_segments, k_segments, doc_starts, sliding_window, scale,
                               dropout_p)
    if dropout_p == 0:
        if plain:
            return _sdpa(q_bnsd, k_bksd, v_bksd, is_causal=True, enable_gqa=gqa)
        q = q_bnsd.to(compute_dtype(q_bnsd))
        return local_attention(q, k_bksd, v_bksd, q_segments, k_segments, doc_starts, sliding_window,
                               scale).to(q_bnsd.dtype)
    if plain and s_q * s_k <= attention_plan.TILE ** 2:
        return _sdpa(q_bnsd, k_bksd, v_bksd, dropout_p=dropout_p, is_causal=True, enable_gqa=gqa)
    groups = row_plans(q_bnsd.shape[0], q_segments, k_segments, doc_starts, sliding_window)
    if len(groups) == 1:  # every row one plan: the tiles' output is the whole
        return dropout_attention(q_bnsd, k_bksd, v_bksd, groups[0][1], sliding_window, scale, dropout_p)
    out = q_bnsd.new_zeros(q_bnsd.shape)
    for rows_b, blocks in groups:
        out[rows_b] = dropout_attention(q_bnsd[rows_b], k_bksd[rows_b], v_bksd[rows_b], blocks, sliding_window,
                                        scale, dropout_p)
    return out


class Attention(nn.Module):
    """Self-attention with one fused QKV projection laid out [q (n*d) | k (k*d) | v (k*d)]."""

    def __init__(self, cfg: ModelConfig, *, tp: TPContext | None = None, cp: CPContext | None = None,
                 store: WeightGradStore | None = None, linear: LinearKind = DEFAULT_LINEAR, device: DeviceLike = None,
                 dtype: torch.dtype | None = None):
        """With ``tp``: this rank's heads (kv heads replicated when tp exceeds them), a column-parallel
        qkv and a row-parallel output projection, of the ``linear`` kind (core/layer_spec.py). With
        ``cp``: this rank's queries attend over every cp rank's keys (context_parallel/context.py)."""
        super().__init__()
        t, d = (tp.size if tp is not None else 1), cfg.head_size
        self.n_heads, self.n_kv, self.d = cfg.num_attention_heads // t, max(1, cfg.kv_heads // t), d
        self.q_size, self.kv_size = self.n_heads * d, self.n_kv * d
        kw = {"store": store, "device": device, "dtype": dtype}
        if tp is None:
            plain = resolve(linear.plain)
            self.qkv = plain(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias, **kw)
            self.o = plain(self.q_size, cfg.hidden_size, bias=cfg.out_proj_bias, **kw)
        else:
            heads, kv = cfg.num_attention_heads * d, cfg.kv_heads * d
            parts = [Part("q", heads, d), Part("k", kv, d), Part("v", kv, d)]
            self.qkv = resolve(linear.column)(cfg.hidden_size, parts, tp, bias=cfg.attention_bias, **kw)
            self.o = resolve(linear.row)(heads, cfg.hidden_size, tp, bias=cfg.out_proj_bias, **kw)
        # Query/key RMSNorms before RoPE: per head (Qwen3: [d] gains, whole on every tp rank) or over the
        # whole projection (OLMoE: [n*d] and [k*d] gains; under tp split like the heads, the statistics
        # all-reduced over tp: SplitRMSNorm).
        self.qk_norm = cfg.qk_norm
        self.q_norm = self.k_norm = None
        if cfg.qk_norm == "projection" and tp is not None:
            self.q_norm, self.k_norm = (SplitRMSNorm(part, tp, cfg.norm_eps, device=device, dtype=dtype)
                                        for part in parts[:2])
        elif cfg.qk_norm is not None:
            q_dim, k_dim = (d, d) if cfg.qk_norm == "head" else (self.q_size, self.kv_size)
            self.q_norm = RMSNorm(q_dim, cfg.norm_eps, device=device, dtype=dtype)
            self.k_norm = RMSNorm(k_dim, cfg.norm_eps, device=device, dtype=dtype)
        self.dropout_p = cfg.attention_dropout
        self.sliding_window = cfg.sliding_window
        self.rope = not cfg.learned_positions
        self.tp, self.cp = tp, (cp if cp is not None and cp.size > 1 else None)

    def forward(self, x_sbh: torch.Tensor, seq: SeqShard, recompute_core: bool = False) -> torch.Tensor:
        """``recompute_core``: keep only the core's inputs and recompute it in backward (selective recompute)."""
        qkv = self.qkv(x_sbh)  # under sequence parallelism the input is s/t long, qkv is all-gathered to s
        s, b = qkv.shape[:2]
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        if self.qk_norm == "projection":
            q, k = self.q_norm(q), self.k_norm(k)
        q_sbnd, k_sbkd = q.view(s, b, self.n_heads, self.d), k.view(s, b, self.n_kv, self.d)
        if self.qk_norm == "head":
            q_sbnd, k_sbkd = self.q_norm(q_sbnd), self.k_norm(k_sbkd)
        q_bnsd = q_sbnd.permute(1, 2, 0, 3)
        k_bksd = k_sbkd.permute(1, 2, 0, 3)
        v_bksd = v.view(s, b, self.n_kv, self.d).permute(1, 2, 0, 3)
        if self.rope:
            assert seq.rope is not None
            q_bnsd = apply_rope(q_bnsd, *seq.rope)
            k_bksd = apply_rope(k_bksd, *seq.rope)
        if seq.past is not None:  # token slices: attend over the earlier slices' keys too (token_slices.py)
            k_bksd, v_bksd = seq.past.extend(self, k_bksd, v_bksd)
        p = self.dropout_p if self.training else 0.0
        core = functools.partial(self._core, seq=seq, dropout_p=p)
        # Heads differ per tp rank, so their dropout masks come from the tp-rank stream.
        rng = self.tp.fork_rng(p > 0) if self.tp is not None else contextlib.nullcontext()
        with rng:
            if recompute_core and self.training:
                # Korthikanti et al.'s selective recompute: keep the core's inputs, recompute its internals.
                # (checkpoint saves and restores the generator it runs under: the forked one here.)
                out_bnsd = torch.utils.checkpoint.checkpoint(core, q_bnsd, k_bksd, v_bksd, use_reentrant=False,
                                                             context_fn=recompute_contexts(q_bnsd))
            else:
                out_bnsd = core(q_bnsd, k_bksd, v_bksd)
        out_sbh = out_bnsd.permute(2, 0, 1, 3).reshape(s, b, self.q_size)
        return self.o(out_sbh)

    def _core(self, q_bnsd: torch.Tensor, k_bksd: torch.Tensor, v_bksd: torch.Tensor, *, seq: SeqShard,
              dropout_p: float) -> torch.Tensor:
        if self.cp is not None:
            if dropout_p > 0:
                raise ValueError(f"attention dropout {dropout_p} under context parallelism: the cp kernels have "
                                 "none; set model.attention_dropout=0 to train with cp")
            return cp_attention(q_bnsd, k_bksd, v_bksd, self.cp, seq, self.sliding_window, self.d ** -0.5)
        return attention_core(q_bnsd, k_bksd, v_bksd, dropout_p=dropout_p, sliding_window=self.sliding_window,
                              seq=seq)

    def parts(self) -> list[tuple[str, list[nn.Module]]]:
        """Parameter-holding submodules in forward order, as ZeRO-3 gathers them (the block adds the norm)."""
        first = [self.qkv] + ([self.q_norm, self.k_norm] if self.q_norm is not None else [])
        return [("attn_in", first), ("attn_out", [self.o])]

    def grad_specs(self) -> list[GradSpec]:
        """Per-head q/k norm gains under tp: every rank's heads add to their gradients (partial sums).
        (Projection norms under tp are SplitRMSNorms, which give their own.)"""
        if self.tp is None or self.qk_norm != "head":
            return []
        return [GradSpec(m.weight, None, self.tp.size, self.tp.comm) for m in (self.q_norm, self.k_norm)]

    def canonical_shards(self, prefix: str) -> dict[str, Shard]:
        """q, k, v and o under ``prefix`` as separate tensors (row slices of the fused qkv: views)."""
        names = {n: f"{prefix}.{n}" for n in ("q", "k", "v")}
        out = fused_shards(self.qkv, names, (self.q_size, self.kv_size, self.kv_size))
        out.update(param_shards(f"{prefix}.o", self.o))
        if self.q_norm is not None:
            out.update(param_shards(f"{prefix}.q_norm", self.q_norm))
            out.update(param_shards(f"{prefix}.k_norm", self.k_norm))
        return out
