"""One decoder-only transformer for the GPT-2 / Llama / Mistral / Qwen2 family.

Shape legend (suffixes on tensor names):
    b  micro-batch size     s  sequence length     h  hidden size     v  vocabulary size
Tokens come in batch-first ``[b, s]`` like Hugging Face; inside, activations are sequence-first
``[s, b, h]`` (see layers/attention.py for why).

Parameters live in fused modules (one QKV and one gate/up matmul per layer) for speed, and are
exposed under layout-free *canonical* names: every module reports its own blocks, and
:meth:`Transformer.canonical_shards` composes them (``canonical_tensors``: the whole-tensor views of a
model without tensor parallelism, no copies). Checkpoints, HF conversion, ZeRO's state rows and
initialisation all work on the canonical names, so a tensor's value never depends on the layout.
Handed a TPContext, each module builds its tensor-parallel layers itself (models/parallelize.py
checks the result against the TP plan).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from mpformer.context_parallel.blockwise import segment_index
from mpformer.context_parallel.context import CPContext, SeqShard, document_ids
from mpformer.context_parallel.token_slices import KVSlices
from mpformer.core.attention_plan import DocStarts
from mpformer.core.layer_spec import DEFAULT_LINEAR, LinearKind, attention_kind, linear_kind, mlp_kind, resolve
from mpformer.core.model_config import ModelConfig
from mpformer.core.model_options import DEFAULT_OPTIONS, ModelOptions
from mpformer.core.pipeline_plan import StagePlan
from mpformer.core.sequence import Segment
from mpformer.core.shards import Shard
from mpformer.layers.attention import RotaryEmbedding
from mpformer.layers.cross_entropy import vocab_parallel_cross_entropy
from mpformer.layers.dropout import Dropout
from mpformer.layers.fp8_layer import recompute_contexts as fp8_recompute_contexts
from mpformer.layers.fused_cross_entropy import fused_linear_cross_entropy
from mpformer.layers.linear import WeightGradStore, linear
from mpformer.layers.norm import build_norm
from mpformer.layers.parallel import VocabParallelEmbedding, VocabParallelHead, gather_input, param_shards
from mpformer.models.fp8 import apply_expert_fp8, apply_fp8, fp8_buffers
from mpformer.models.init import ModelInit, init_weights
from mpformer.parallel.comm import gather_from_region
from mpformer.parallel.device import DeviceLike, compose_contexts, recompute_contexts
from mpformer.parallel.expert_parallel import EPContext
from mpformer.parallel.tensor_parallel import TPContext


def sp_rng(tp: TPContext | None, active: bool) -> contextlib.AbstractContextManager:
    """The tp-rank dropout stream for sequence-parallel regions, else nothing."""
    return tp.fork_rng(active) if tp is not None and tp.sequence_parallel else contextlib.nullcontext()


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)). The attention and the MLP are
    the kinds ``cfg`` names, built with the ``linear`` kind (core/layer_spec.py); each module gives its
    ``canonical_shards(prefix)`` and ``parts()``."""

    def __init__(self, cfg: ModelConfig, *, use_apex: bool, tp: TPContext | None = None, cp: CPContext | None = None,
                 store: WeightGradStore | None = None, linear: LinearKind = DEFAULT_LINEAR, device: DeviceLike = None,
                 dtype: torch.dtype | None = None, layer: int = 0, ep: EPContext | None = None):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.attn_norm = build_norm(cfg.norm_type, cfg.hidden_size, cfg.norm_eps, use_apex=use_apex, **kw)
        attention = resolve(attention_kind(cfg.attention_kind).module)
        self.attn = attention(cfg, tp=tp, cp=cp, store=store, linear=linear, **kw)
        self.mlp_norm = build_norm(cfg.norm_type, cfg.hidden_size, cfg.norm_eps, use_apex=use_apex, **kw)
        kind = mlp_kind(cfg.layer_mlp_kind(layer))
        contexts = {name: {"ep": ep}[name] for name in kind.needs}
        self.mlp = resolve(kind.module)(cfg, tp=tp, store=store, linear=linear, **contexts, **kw)
        place = getattr(self.mlp, "place", None)
        if place is not None:  # an MLP that reports per layer (experts' load) learns where it sits
            place(layer, cp if cp is not None and cp.size > 1 else None)
        self.dropout = Dropout(cfg.hidden_dropout)
        self.tp = tp

    def forward(self, x_sbh: torch.Tensor, seq: SeqShard, recompute_core: bool = False) -> torch.Tensor:
        """``recompute_core``: selective recompute of the attention core (Korthikanti et al.) and of an MLP
        that has one to offer (``selective_recompute``: the experts' GEMMs and activation)."""
        x_sbh = x_sbh + self._dropout(self.attn(self.attn_norm(x_sbh), seq, recompute_core))
        mlp_in = self.mlp_norm(x_sbh)
        out = self.mlp(mlp_in, recompute_core) if getattr(self.mlp, "selective_recompute", False) else self.mlp(mlp_in)
        return x_sbh + self._dropout(out)

    def parts(self) -> list[tuple[str, list[nn.Module]]]:
        """The block's parameter-holding submodules in forward order, as ZeRO-3 gathers them (optim/engine.py):
        each norm with the first part of the module it feeds. Every parameter of the block is in exactly one part."""
        out = []
        for norm, module in ((self.attn_norm, self.attn), (self.mlp_norm, self.mlp)):
            (name, first), *rest = module.parts()
            out += [(name, [norm, *first]), *rest]
        return out

    def _dropout(self, x_sbh: torch.Tensor) -> torch.Tensor:
        # Sequence-parallel chunks differ per tp rank: tp-rank stream. Otherwise every tp rank holds
        # the same residual stream and must draw the same mask: default stream.
        with sp_rng(self.tp, self.dropout.p > 0 and self.training):
            return self.dropout(x_sbh)

    def canonical_shards(self, prefix: str) -> dict[str, Shard]:
        out = param_shards(f"{prefix}.attn_norm", self.attn_norm)
        out.update(self.attn.canonical_shards(f"{prefix}.attn"))
        out.update(param_shards(f"{prefix}.mlp_norm", self.mlp_norm))
        out.update(self.mlp.canonical_shards(f"{prefix}.mlp"))
        return out


class RegionHooks(Protocol):
    """Called around the parts of forward that read parameters outside the layers (ZeRO-3 gathers
    them there, optim/gather.py): ``enter(name)`` before, ``leave(name, out)`` after, with the part's
    output (whose gradient marks the start of the part's backward)."""

    def enter(self, name: str) -> None: ...

    def leave(self, name: str, out: Any) -> None: ...


class Transformer(nn.Module):
    """Decoder-only LM. ``forward(tokens_bs)`` gives logits ``[b, s, v]``; with labels, the mean loss."""

    def __init__(self, cfg: ModelConfig, options: ModelOptions = DEFAULT_OPTIONS, *, tp: TPContext | None = None,
                 cp: CPContext | None = None, store: WeightGradStore | None = None, stage: StagePlan | None = None,
                 device: DeviceLike = None, dtype: torch.dtype | None = None, seed: int | None = 1234,
                 ep: EPContext | None = None) -> None:
        """``options``: how the model is built (core/model_options.py: recompute, document masks, the
        loss path). ``stage`` picks the layers, embedding and head a pipeline rank holds (default: all).
        Layers keep their global indices in canonical names; with tied embeddings the last stage
        holds its own copy of the embedding for the head (kept equal by the gradient engine).
        ``tp``: every module builds its tensor-parallel layers (models/parallelize.py checks the plan);
        ``store``: the zero-bubble pipeline's WeightGradStore for every linear layer's weights.
        ``cp``: this rank holds its context-parallel part of every sequence (it is given whole micro-batches
        and picks its positions itself)."""
        super().__init__()
        self.cfg = cfg.validate()
        kw = {"device": device, "dtype": dtype}
        embedding, head = (True, True) if stage is None else (stage.has_embedding, stage.has_head)
        self.has_embedding, self.has_head = embedding, head
        self.layer_ids = list(range(cfg.num_layers)) if stage is None else stage.layer_ids
        self.options = options
        use_apex = options.use_apex
        need_embed = embedding or (head and cfg.tie_embeddings)
        h, v = cfg.hidden_size, cfg.vocab_size
        self.embed = None
        if need_embed:
            self.embed = nn.Embedding(v, h, **kw) if tp is None else VocabParallelEmbedding(v, h, tp, **kw)
        self.pos_embed = (nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size, **kw)
                          if cfg.learned_positions and embedding else None)
        self.rotary = None if cfg.learned_positions else RotaryEmbedding(cfg, device=device)
        self.embed_dropout = Dropout(cfg.hidden_dropout)
        self.layers = nn.ModuleList(
            Block(cfg, use_apex=use_apex, tp=tp, cp=cp, store=store, linear=linear_kind(options.linear_kind),
                  layer=i, ep=ep, **kw)
            for i in self.layer_ids)
        self.final_norm = (build_norm(cfg.norm_type, cfg.hidden_size, cfg.norm_eps, use_apex=use_apex, **kw)
                           if head else None)
        self.lm_head = None
        if head and not cfg.tie_embeddings:
            self.lm_head = nn.Linear(h, v, bias=False, **kw) if tp is None else VocabParallelHead(h, v, tp, **kw)
        self.tp, self.store = tp, store
        self.cp = cp if cp is not None and cp.size > 1 else None
        self.region_hooks: RegionHooks | None = None  # set by ZeRO-3 (optim/gather.py)
        # train.precision=fp8: the float8 linears chosen by name (models/fp8.py), before any buffer is made real
        tokens = (self.cp.comm,) if self.cp is not None else ()
        self.fp8_layers = (apply_fp8(self, options.fp8, self.layer_ids, self.canonical_shards, tokens)
                           if options.fp8 else [])
        self.fp8_layers += apply_expert_fp8(self, options.fp8, self.layer_ids) if options.fp8 else []  # routed experts
        if seed is not None and (device is None or torch.device(device).type != "meta"):
            self.init_weights(seed)

    def compile_layers(self, **options) -> None:
        """torch.compile every block's ``forward`` (train.compile). Per block, not the whole model:
        the blocks share one code object, so they share one compiled graph and compiling costs one
        block's time whatever the depth (Megatron-style per-layer regional compilation, as torchtitan
        does); hooks on the blocks (ZeRO-3's gathers), activation checkpointing around them and the
        collectives between stages stay outside the graph. Inductor draws its own dropout masks, so a
        compiled run with dropout matches an eager one in distribution, not bit for bit."""
        for layer in self.layers:
            layer.forward = torch.compile(layer.forward, **options)

    # ---- forward ---------------------------------------------------------------------------
    def sequence(self, tokens_bs: torch.Tensor, past: KVSlices | None = None, part: int = 0, *,
                 doc_starts: tuple[DocStarts, ...] | None = None) -> SeqShard:
        """What this rank holds of the micro-batch's sequence: its context-parallel positions (all of
        them without cp), the document ids (document masks) and the rotary tables at its positions.
        ``past``: token slices (context_parallel/token_slices.py), this is slice ``part`` of
        ``past.slices`` equal ones; as under cp, its positions are ``index`` and its loss is its share.
        ``doc_starts``: each row's document starts as the loader found them on the host (training);
        without them they are read from the tokens' document ids (a host copy: on a GPU, a sync)."""
        s = tokens_bs.shape[1]
        if past is not None:
            assert self.cp is None, "token slices under context parallelism (layout.validate rejects it)"
            n = s // past.slices
            segments: tuple[Segment, ...] = (Segment(part * n, n),)
        else:
            segments = self.cp.segments(s) if self.cp is not None else (Segment(0, s),)
        index = segment_index(segments, tokens_bs.device) if self.cp is not None or past is not None else None
        docs = document_ids(tokens_bs, self.options.document_eos) if self.options.document_eos is not None else None
        rope = None
        if self.rotary is not None:
            rope = self.rotary(s) if index is None else self.rotary.at(index)
        return SeqShard(s, segments, index, docs, rope, past, doc_starts if docs is not None else None)

    def hidden_states(self, tokens_bs: torch.Tensor) -> torch.Tensor:
        """Final-norm output ``[s, b, h]`` (the whole model on one pipeline stage; cp: this rank's positions)."""
        seq = self.sequence(tokens_bs)
        x_sbh = self.run_layers(self.embed_tokens(tokens_bs, seq), range(len(self.layers)), seq)
        return self.final_norm(x_sbh)

    def embed_tokens(self, tokens_bs: torch.Tensor, seq: SeqShard) -> torch.Tensor:
        """The first stage's input: token (and position) embeddings of this rank's positions, ``[s(/cp)(/t), b, h]``."""
        s = tokens_bs.shape[1]
        if seq.index is not None:
            tokens_bs = tokens_bs.index_select(1, seq.index)
        x_sbh = self.embed(tokens_bs.t())
        if self.pos_embed is not None:
            if s > self.cfg.max_position_embeddings:
                raise ValueError(f"sequence length {s} exceeds max_position_embeddings="
                                 f"{self.cfg.max_position_embeddings}")
            pos = seq.index if seq.index is not None else torch.arange(s, device=x_sbh.device)
            if self.tp is not None and self.tp.sequence_parallel:  # this tp rank's part of the positions
                pos = pos.chunk(self.tp.size)[self.tp.rank]
            x_sbh = x_sbh + self.pos_embed.weight[pos][:, None, :]
        with sp_rng(self.tp, self.embed_dropout.p > 0 and self.training):
            return self.embed_dropout(x_sbh)

    def run_layers(self, x_sbh: torch.Tensor, local: Iterable[int], seq: SeqShard) -> torch.Tensor:
        """The layers at positions ``local`` of this module (a pipeline chunk) on ``x``; recompute on the
        chunk's first ``recompute_layers`` layers."""
        for n, i in enumerate(local):
            layer = self.layers[i]
            mode = self.recompute_mode(n)
            if mode == "full":
                inner = compose_contexts(self.tp.checkpoint_context_fn() if self.tp is not None else None,
                                         fp8_recompute_contexts(layer))  # delayed scaling replays its scales
                x_sbh = checkpoint(layer, x_sbh, seq, use_reentrant=False, context_fn=recompute_contexts(x_sbh, inner))
            else:
                x_sbh = layer(x_sbh, seq, mode == "selective")
        return x_sbh

    def recompute_mode(self, n: int) -> str:
        """How the ``n``-th layer of a chunk recomputes in training (none | selective | full); "full" runs
        its forward again inside its backward (ZeRO-3 gathers its units again there)."""
        if not self.training or (self.options.recompute_layers is not None and n >= self.options.recompute_layers):
            return "none"
        return self.options.recompute

    def head_output(self, x_sbh: torch.Tensor, labels_bs: torch.Tensor | None, seq: SeqShard) -> torch.Tensor:
        """The last stage: final norm, then the loss (or logits ``[b, s, v]`` without labels; under cp
        ``[b, s/cp, v]`` at this rank's positions, ``seq.index``, in its storage order). Under cp the
        loss is this rank's share of the micro-batch's mean (its tokens' summed loss over every cp rank's
        token count): the shares sum to the mean, and their gradients sum over cp to its gradient."""
        hidden_sbh = self.final_norm(x_sbh)
        local = labels_bs if labels_bs is None or seq.index is None else labels_bs.index_select(1, seq.index)
        if labels_bs is not None and self.options.fused_cross_entropy:
            return self._fused_loss(hidden_sbh, local, labels_bs)
        if self.tp is not None:
            loss = self._tp_output(hidden_sbh, local)
        else:
            logits_sbv = linear(hidden_sbh, self.output_weight(), store=self.store)
            if labels_bs is None:
                return logits_sbv.transpose(0, 1)
            # Mean next-token cross entropy over every labelled token, computed in fp32; under cp the
            # sum over this rank's tokens divided by the count over all (a rank with none gives 0, not nan).
            flat = (logits_sbv.float().flatten(0, 1), local.t().reshape(-1))
            if seq.index is None:
                return F.cross_entropy(*flat, ignore_index=-100)
            return F.cross_entropy(*flat, ignore_index=-100, reduction="sum") / (labels_bs != -100).sum()
        if labels_bs is None or seq.index is None:
            return loss
        return loss * ((local != -100).sum() / (labels_bs != -100).sum())  # the vocab-parallel mean, as a share

    def _fused_loss(self, hidden_sbh: torch.Tensor, local_bs: torch.Tensor, labels_bs: torch.Tensor) -> torch.Tensor:
        """head_output's loss without the logits: the summed loss of this rank's tokens (``local_bs``),
        over the labelled-token count of the whole micro-batch (``labels_bs``: under cp every rank's, so
        this is the rank's share). As the unfused paths: nan without labelled tokens, 0 under tp."""
        tp, kw = self.tp, {}
        if tp is not None:
            head = self.embed if self.lm_head is None else self.lm_head
            hidden_sbh = gather_input(hidden_sbh, tp)  # backward: dX summed over tp (reduce-scattered under SP)
            kw = {"comm": tp.comm, "start": head.start, "valid": head.valid}
        total = fused_linear_cross_entropy(hidden_sbh.flatten(0, 1), self.output_weight(), local_bs.t().reshape(-1),
                                           chunk=self.options.cross_entropy_chunk, store=self.store, **kw)
        count = (labels_bs != -100).sum()
        return total / (count.clamp(min=1) if tp is not None and self.cp is None else count)

    def output_weight(self) -> torch.Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, tokens_bs: torch.Tensor, labels_bs: torch.Tensor | None = None,
                doc_starts: tuple[DocStarts, ...] | None = None) -> torch.Tensor:
        """The whole model (a module holding every layer, the embedding and the head); ``doc_starts``: the
        rows' document starts found on the host (``sequence``)."""
        seq = self.sequence(tokens_bs, doc_starts=doc_starts)
        x_sbh = self._region("embedding", self.embed_tokens, tokens_bs, seq)
        x_sbh = self.run_layers(x_sbh, range(len(self.layers)), seq)
        return self._region("head", self.head_output, x_sbh, labels_bs, seq)

    def region_params(self) -> dict[str, list[nn.Parameter]]:
        """The parameters outside the layers by the part of forward that reads them: ``embedding``
        (token and position embeddings, embed_tokens) and ``head`` (final norm and LM head,
        head_output; a tied head reads the embedding's weight, which is listed under ``embedding``)."""
        embedding = [p for m in (self.embed, self.pos_embed) if m is not None for p in m.parameters()]
        head = [p for m in (self.final_norm, self.lm_head) if m is not None for p in m.parameters()]
        return {"embedding": embedding, "head": head}

    def _region(self, name: str, fn: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
        hooks = self.region_hooks
        if hooks is None:
            return fn(*args)
        hooks.enter(name)
        out = fn(*args)
        hooks.leave(name, out)
        return out

    def _tp_output(self, hidden_sbh: torch.Tensor, labels_bs: torch.Tensor | None) -> torch.Tensor:
        """Logits of this rank's vocabulary block; the loss without gathering them (vocab-parallel
        cross entropy), or the full logits (padding dropped) when no labels are given."""
        tp, head = self.tp, (self.embed if self.lm_head is None else self.lm_head)
        logits_sbv = linear(gather_input(hidden_sbh, tp), self.output_weight(), store=self.store)
        if labels_bs is None:
            full = gather_from_region(logits_sbv, tp.comm, dim=-1)
            return full[..., : self.cfg.vocab_size].transpose(0, 1)
        return vocab_parallel_cross_entropy(logits_sbv.flatten(0, 1), labels_bs.t().reshape(-1), tp.comm,
                                            head.start, head.valid)

    # ---- layout-free view and initialisation ---------------------------------------------
    def canonical_shards(self) -> dict[str, Shard]:
        """Canonical name -> this rank's block of it (the whole tensor without tensor parallelism).
        Every module names its own parameters; this is the one tree of names that checkpoints,
        initialisation, ZeRO's state rows and HF conversion use."""
        out = param_shards("embedding.word", self.embed) if self.embed is not None else {}
        if self.pos_embed is not None:
            out.update(param_shards("embedding.position", self.pos_embed))
        for i, layer in zip(self.layer_ids, self.layers):
            out.update(layer.canonical_shards(f"layers.{i}"))
        if self.final_norm is not None:
            out.update(param_shards("final_norm", self.final_norm))
        if self.lm_head is not None:
            out.update(param_shards("lm_head", self.lm_head))
        return out

    def canonical_buffers(self) -> dict[str, Shard]:
        """Non-parameter state a checkpoint keeps (not trained by the optimizer, not in HF files): each
        layer's MLP's ``canonical_buffers`` (an expert router's selection bias) and each float8 linear's
        delayed-scaling state (models/fp8.py), by canonical name."""
        out: dict[str, Shard] = {}
        for i, layer in zip(self.layer_ids, self.layers):
            own = getattr(layer.mlp, "canonical_buffers", None)
            if own is not None:
                out.update(own(f"layers.{i}.mlp"))
        out.update(fp8_buffers(self, self.layer_ids))  # delayed scaling's amax histories and scales
        return out

    def canonical_tensors(self) -> dict[str, torch.Tensor]:
        """Every parameter under its layout-free name, as views into the module's storage (a model
        that holds whole tensors: no tensor parallelism)."""
        shards = self.canonical_shards()
        assert all(sh.is_full for sh in shards.values()), "canonical_tensors of a tensor-parallel model"
        return {k: sh.local for k, sh in shards.items()}

    def init_weights(self, seed: int) -> None:
        """Megatron-style init of every canonical tensor, drawn in row blocks from generators seeded by
        (seed, name, block) (models/init.py): any layout draws only its blocks and gets the values of
        the single-device model."""
        init_weights(self, ModelInit(self.cfg, seed))
