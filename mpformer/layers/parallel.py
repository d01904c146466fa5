"""Tensor-parallel layers: column- and row-parallel linears, the vocabulary-parallel embedding.

Shape legend: s sequence (s/t under sequence parallelism), b micro-batch, h hidden, t tp size.

    ColumnParallelLinear   x [s(/t), b, h]  -- copy_to | all_gather -->  [s, b, h] @ W_r^T -> [s, b, out/t]
                           (under SP the gather is inside the linear, which keeps the shard for backward)
    RowParallelLinear      x [s, b, in/t] @ W_r^T -> partial [s, b, h] -- reduce | reduce_scatter_seq --> + bias
    VocabParallelEmbedding ids [s, b] -> rows of this rank's vocabulary block -- reduce | reduce_scatter_seq

The modules that use them (attention, MLP, the transformer's embedding and head) build them in
their constructors when given a TPContext; models/parallelize.py checks the result against the
TP plan.
Each layer reports its canonical shards (for checkpoints and initialisation; ``param_shards`` and
``fused_shards`` give the same names for plain and parallel modules alike) and its gradient specs
(which rows are replicated over tp and which need a gradient all-reduce).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mpformer.core.shards import Shard
from mpformer.layers.fp8_layer import Float8Layer
from mpformer.layers.fp8_linear import Fp8Shards
from mpformer.layers.linear import WeightGradStore, linear
from mpformer.parallel.comm import Comm, all_gather_seq, copy_to_region, reduce_from_region, reduce_scatter_seq
from mpformer.parallel.device import autocast_dtype
from mpformer.parallel.tensor_parallel import GradSpec, Part, TPContext, vocab_block


def gather_input(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """Enter a tensor-parallel region: all-gather the sequence (SP) or mark the identity copy. Under
    autocast the input is cast first, so the collective (and its backward dual) moves 16-bit data."""
    if (dt := autocast_dtype(x)) is not None:
        x = x.to(dt)
    return all_gather_seq(x, tp.comm) if tp.sequence_parallel else copy_to_region(x, tp.comm)


def param_shards(name: str, m: nn.Module) -> dict[str, Shard]:
    """``name.weight`` (and ``name.bias``) of ``m``: a parallel layer's own blocks, or, for a plain
    module (a norm, an embedding, a linear), its parameters as whole tensors."""
    own = getattr(m, "canonical_shards", None)
    if own is not None:
        return own(name)
    return {f"{name}.{k}": Shard.full(p) for k, p in m.named_parameters(recurse=False)}


def fused_shards(m: nn.Module, names: dict[str, str], sizes: Sequence[int]) -> dict[str, Shard]:
    """A fused projection (q|k|v, gate|up) as its parts: ``names`` maps a part to its canonical prefix
    and ``sizes`` gives the parts' rows in the single-device weight. A column-parallel layer reports
    this rank's block of each part; a plain one its row slices (views, whole tensors)."""
    if isinstance(m, ColumnParallelLinear):
        return m.canonical_shards(names)
    out: dict[str, Shard] = {}
    for prefix, w in zip(names.values(), m.weight.split(list(sizes), dim=0)):
        out[f"{prefix}.weight"] = Shard.full(w)
    if m.bias is not None:
        for prefix, b in zip(names.values(), m.bias.split(list(sizes), dim=0)):
            out[f"{prefix}.bias"] = Shard.full(b)
    return out


def reduce_output(y: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """Leave it: sum the partial outputs, keeping this rank's sequence chunk under SP."""
    return reduce_scatter_seq(y, tp.comm) if tp.sequence_parallel else reduce_from_region(y, tp.comm)


class ColumnParallelLinear(Float8Layer):
    """Output rows split over tp, part by part (a fused projection keeps ``[part_0 r | part_1 r ...]``).
    In float8 (Float8Layer) the weight's and dY's amaxes span tp (N is split), and under sequence
    parallelism the input is cast to float8 before its all-gather (layers/fp8_linear.py)."""

    def __init__(self, in_features: int, parts: list[Part], tp: TPContext, *, bias: bool,
                 store: WeightGradStore | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.parts, self.tp, self.store = parts, tp, store
        self.blocks = [p.block(tp.rank, tp.size) for p in parts]  # (global start, rows) per part
        rows = sum(n for _, n in self.blocks)
        self.weight = nn.Parameter(torch.empty(rows, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(rows, device=device, dtype=dtype)) if bias else None

    def fp8_split(self, tokens: tuple[Comm, ...]) -> Fp8Shards:
        seq = self.tp.comm if self.tp.sequence_parallel else None
        return Fp8Shards(tokens=tokens, n=self.tp.comm, seq=seq)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8 is not None:  # x as it is: the float8 cast is the only one (as on one device)
            sp = self.tp.sequence_parallel and self.tp.size > 1
            return self.fp8_forward(x if sp else copy_to_region(x, self.tp.comm), self.bias)
        if not self.tp.sequence_parallel or self.tp.size == 1:
            return linear(gather_input(x, self.tp), self.weight, self.bias, self.store)
        if (dt := autocast_dtype(x)) is not None:  # the collectives move 16-bit data (as gather_input)
            x = x.to(dt)
        # the sequence gathered inside the linear: its backward keeps this rank's shard (layers/linear.py)
        return linear(x, self.weight, self.bias, self.store, seq=self.tp.comm)

    def forward_parts(self, x: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
        """The output's ``n`` parts (this rank's rows of each, back to back): one GEMM, then views."""
        return self(x).chunk(n, dim=-1)

    def _local_rows(self) -> list[tuple[int, int]]:
        out, at = [], 0
        for _, n in self.blocks:
            out.append((at, at + n))
            at += n
        return out

    def canonical_shards(self, names: dict[str, str]) -> dict[str, Shard]:
        """``names`` maps a part name to its canonical prefix (e.g. "q" -> "layers.0.attn.q")."""
        out = {}
        for part, (start, _), (a, b) in zip(self.parts, self.blocks, self._local_rows()):
            out[f"{names[part.name]}.weight"] = Shard.rows(self.weight[a:b], part.rows, start)
            if self.bias is not None:
                out[f"{names[part.name]}.bias"] = Shard.rows(self.bias[a:b], part.rows, start)
        return out

    def grad_specs(self) -> list[GradSpec]:
        specs = []
        for part, rows in zip(self.parts, self._local_rows()):
            reps = part.replicas(self.tp.size)
            sync = self.tp.replica_comm(reps) if reps > 1 else None
            specs += [GradSpec(p, rows, reps, sync) for p in (self.weight, self.bias) if p is not None]
        return specs


class RowParallelLinear(Float8Layer):
    """Input columns split over tp; partial outputs summed (or reduce-scattered), then the bias. In
    float8 (Float8Layer) the input's and weight's amaxes span tp (K is split)."""

    def __init__(self, in_features: int, out_features: int, tp: TPContext, *, bias: bool,
                 store: WeightGradStore | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if in_features % tp.size:
            raise ValueError(f"row-parallel input of {in_features} does not split over tp={tp.size}")
        self.tp, self.in_features, self.store = tp, in_features, store
        self.cols = in_features // tp.size
        self.weight = nn.Parameter(torch.empty(out_features, self.cols, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None

    def fp8_split(self, tokens: tuple[Comm, ...]) -> Fp8Shards:
        return Fp8Shards(tokens=tokens, k=self.tp.comm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = self.fp8_forward(x, None) if self.fp8 is not None else linear(x, self.weight, store=self.store)
        y = reduce_output(partial, self.tp)
        return y + self.bias if self.bias is not None else y

    def canonical_shards(self, name: str) -> dict[str, Shard]:
        start = self.tp.rank * self.cols
        out = {f"{name}.weight": Shard(self.weight, (self.weight.shape[0], self.in_features), (0, start))}
        if self.bias is not None:
            out[f"{name}.bias"] = Shard.full(self.bias)
        return out

    def grad_specs(self) -> list[GradSpec]:
        specs = [GradSpec(self.weight)]
        if self.bias is not None:  # replicated; under SP each rank saw only its sequence chunk
            specs.append(GradSpec(self.bias, None, self.tp.size, self.tp.comm if self.tp.sequence_parallel else None))
        return specs


class VocabParallelEmbedding(nn.Module):
    """Vocabulary rows split over tp; the vocabulary is padded to a multiple of tp, and the padding
    rows are never looked up, never reach the loss (masked in the cross entropy) or a checkpoint."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPContext, *,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.tp, self.vocab_size = tp, vocab_size
        self.start, self.rows, self.valid = vocab_block(vocab_size, tp.size, tp.rank)
        self.weight = nn.Parameter(torch.empty(self.rows, hidden, device=device, dtype=dtype))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.start + self.rows)
        local = (ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_output(out, self.tp)

    def canonical_shards(self, name: str) -> dict[str, Shard]:
        return {f"{name}.weight": Shard.rows(self.weight[: self.valid], self.vocab_size, self.start)}

    def grad_specs(self) -> list[GradSpec]:
        return [GradSpec(self.weight)]


class VocabParallelHead(nn.Module):
    """The untied LM head: this rank's vocabulary block of logits, from the full (gathered) hidden."""

    def __init__(self, hidden: int, vocab_size: int, tp: TPContext, *,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.tp, self.vocab_size = tp, vocab_size
        self.start, self.rows, self.valid = vocab_block(vocab_size, tp.size, tp.rank)
        self.weight = nn.Parameter(torch.empty(self.rows, hidden, device=device, dtype=dtype))

    def canonical_shards(self, name: str) -> dict[str, Shard]:
        return {f"{name}.weight": Shard.rows(self.weight[: self.valid], self.vocab_size, self.start)}

    def grad_specs(self) -> list[GradSpec]:
        return [GradSpec(self.weight)]
