"""Mixture of experts: a router choosing k of E experts per token, the experts, and shared experts.

Shape legend: s sequence, b micro-batch, h hidden, T = s*b tokens (s-major: token t = s_i*b + b_i),
k experts per token, E experts, E_l this rank's experts, f one expert's ffn width, M routed rows.

    x_th --router--> weights_tk, experts_tk          (core/moe_config.py: softmax or sigmoid routing)
    x_th --dispatch--> x_mh (grouped by local expert, counts)   (layers/moe_dispatch.py)
    x_mh --experts--> y_mh                            one grouped GEMM per projection (layers/expert_gemm.py)
    y_mh --combine--> slots [T*k, h] --sum_j weights_tj * slot_tj--> y_th   (+ shared experts)

Router training (``RouterLoss``): the load-balancing loss E * sum_i f_i * P_i (Switch/GShard; f_i the
share of the k*T choices that went to expert i, P_i the mean router probability of expert i) and the
router z-loss (ST-MoE: mean logsumexp(logits)^2) are taken *per sequence* and averaged over sequences,
as the cross entropy is: the same value whatever the micro-batching, dp, pp; counts over a sequence
split by cp or sequence parallelism are summed over those ranks first. The losses reach backward without
passing through the pipeline's loss: ``AddAuxGrad`` returns the layer's output unchanged and, in backward,
gives the loss's gradient (its coefficient times the step's loss scale over the micro-batches: the same
factor the cross entropy's gradient carries) to the router (Megatron's MoEAuxLossAutoScaler). DeepSeek-V3's
auxiliary-loss-free balancing moves a per-expert selection bias by the step's observed load (``update_bias``)
outside the gradient.
"""

from __future__ import annotations

import collections
import dataclasses
import math

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from mpformer.context_parallel.context import CPContext
from mpformer.core.layer_spec import DEFAULT_LINEAR, LinearKind
from mpformer.core.model_config import ModelConfig
from mpformer.core.shards import Shard
from mpformer.layers import fp8_expert_gemm as fp8x
from mpformer.layers.expert_gemm import choose_method, expert_mlp
from mpformer.layers.fp8 import Float8Recipe
from mpformer.layers.fp8_layer import DelayedReplay, recompute_contexts
from mpformer.layers.fp8_linear import ONE, Fp8Shards
from mpformer.layers.linear import WeightGradStore
from mpformer.layers.mlp import MLP
from mpformer.layers.moe_dispatch import LocalDispatcher, TokenDispatcher, build_dispatcher, histogram
from mpformer.layers.parallel import gather_input, param_shards, reduce_output
from mpformer.parallel.comm import Comm, reduce_from_region
from mpformer.parallel.device import DeviceLike, kernel_device
from mpformer.parallel.expert_parallel import EPContext
from mpformer.parallel.tensor_parallel import GradSpec, TPContext


class AddAuxGrad(torch.autograd.Function):
    """Identity on ``y``; in backward, ``aux`` (a scalar loss computed from the router) gets gradient
    ``scale``, as if ``scale * aux`` had been added to the loss being differentiated."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale, ctx.aux_shape, ctx.aux_dtype = scale, aux.shape, aux.dtype
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g, torch.full(ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype, device=g.device), None


@dataclasses.dataclass
class RouterStats:
    """What one MoE layer saw over the micro-batches since the last ``take`` (on the device, no sync):
    tokens routed per expert, slots dropped by the capacity limit, and the summed per-micro-batch aux
    and z losses (unscaled by their coefficients)."""

    load: torch.Tensor  # [E] fp32
    dropped: torch.Tensor  # [] fp32
    aux: torch.Tensor  # [] fp32
    z: torch.Tensor  # [] fp32
    micro_batches: int = 0


class Router(nn.Module):
    """Scores ``[T, E]`` from one ``[E, h]`` weight (replicated: every tp rank routes alike), the top k,
    and their weights. ``bias``: DeepSeek-V3's selection bias, a buffer moved outside the gradient
    (``update_bias``), fp32."""

    def __init__(self, cfg: ModelConfig, device: DeviceLike = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        e = cfg.num_experts
        self.weight = nn.Parameter(torch.empty(e, cfg.hidden_size, device=device, dtype=dtype))
        self.register_buffer("bias", torch.zeros(e, device=device) if cfg.router_bias else None)
        self.k, self.e, self.score, self.norm = cfg.num_experts_per_tok, e, cfg.router_score, cfg.norm_topk_prob
        self.groups, self.topk_groups = cfg.router_groups, cfg.router_topk_groups
        self.scaling = cfg.routed_scaling_factor

    def reset_buffers(self, device: DeviceLike) -> None:
        if self.bias is not None:
            self.bias = torch.zeros(self.e, device=device)

    def forward(self, x_th: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(weights_tk fp32, experts_tk int64, probs_te fp32 (for the balancing loss), logits_te)."""
        logits = F.linear(x_th, self.weight)
        if self.score == "softmax":
            probs = torch.softmax(logits.float(), dim=-1)
            weights, experts = torch.topk(probs, self.k, dim=-1)
            if self.norm:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return weights, experts, probs, logits
        probs = torch.sigmoid(logits.float())
        choice = probs if self.bias is None else probs + self.bias
        if self.groups > 1:  # keep the experts of the best groups (by their two best scores), as DeepSeek-V3
            t = choice.shape[0]
            grouped = choice.view(t, self.groups, -1)
            best = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
            keep = torch.zeros_like(best).scatter_(1, best.topk(self.topk_groups, dim=-1).indices, 1.0)
            # -inf, not 0: a trained selection bias is often negative, and a 0 would then outrank eligible experts
            choice = choice.masked_fill(~keep.bool().repeat_interleave(self.e // self.groups, dim=1), float("-inf"))
        experts = torch.topk(choice, self.k, dim=-1).indices
        weights = probs.gather(1, experts)
        if self.norm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, experts, probs, logits


class Experts(DelayedReplay):
    """E_l SwiGLU experts in two flat parameters, so a grouped GEMM reads them as ``[E_l, 2f, h]`` and
    ``[E_l, h, f]`` views: ``up`` holds each expert's gate rows then its up rows (``[E_l*2f, h]``),
    ``down`` each expert's ``[h, f]`` (``[E_l*h, f]``). Whole rows per expert: checkpoints and the
    ZeRO state map see per-expert canonical tensors (``experts.{e}.gate|up|down.weight``, HF's).
    ``tp`` (etp = tp): every expert's ffn split over the tp ranks (f/t rows of gate and up, f/t
    columns of down), as the dense MLP's; the outputs are then partial sums over tp. ``tokens``: the
    groups whose ranks hold these experts' other rows of the same sequences (``MoE.token_peers``): in
    float8 each expert's amaxes span them, so its token block is cast as one process holding it whole."""

    def __init__(self, cfg: ModelConfig, local: range, tp: TPContext | None = None, device: DeviceLike = None,
                 dtype: torch.dtype | None = None, tokens: tuple[Comm, ...] = ()) -> None:
        super().__init__()
        t = tp.size if tp is not None else 1
        self.tokens, self.tp_comm = tokens, tp.comm if tp is not None else None
        self.local, self.h, self.f_full, self.f = local, cfg.hidden_size, cfg.expert_ffn_size, cfg.expert_ffn_size // t
        self.start = (tp.rank if tp is not None else 0) * self.f  # this rank's first ffn row of each expert
        self.split = tp is not None
        n = len(local)
        self.up = nn.Parameter(torch.empty(n * 2 * self.f, self.h, device=device, dtype=dtype))
        self.down = nn.Parameter(torch.empty(n * self.h, self.f, device=device, dtype=dtype))
        self.fp8: Float8Recipe | None = None
        self.fp8_shards = (ONE, ONE)

    def enable_fp8(self, recipe: Float8Recipe) -> None:
        """Float8 GEMMs from now on (layers/fp8_expert_gemm.py). Delayed scaling keeps, per local expert,
        projection (up, down) and role, its amax histories and scales as the buffers ``fp8_amax_history``
        [E_l, 2, 3, H] and ``fp8_scale`` [E_l, 2, 3] (checkpointed per expert: ``fp8_buffers``). Split over
        etp, the up projection's N (gate/up rows) and the down projection's K (its columns) are tp's."""
        self.fp8 = recipe
        self.fp8_shards = (Fp8Shards(self.tokens, n=self.tp_comm), Fp8Shards(self.tokens, k=self.tp_comm))
        self.fp8_stash = collections.deque()
        if recipe.name == "delayed":
            hist, scales = fp8x.expert_scaling_buffers(recipe, len(self.local), self.up.device)
            self.register_buffer("fp8_amax_history", hist)
            self.register_buffer("fp8_scale", scales)

    def reset_buffers(self, device: DeviceLike) -> None:
        if self.fp8 is not None and self.fp8.name == "delayed":
            self.fp8_amax_history, self.fp8_scale = fp8x.expert_scaling_buffers(self.fp8, len(self.local), device)

    def _fp8_buffers(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        # read per call: a checkpoint load or .to() may have replaced the buffer tensors
        return (self.fp8_amax_history, self.fp8_scale) if self.fp8 is not None and self.fp8.name == "delayed" else None

    def _fp8_states(self) -> tuple[fp8x.ExpertScalingState, fp8x.ExpertScalingState] | None:
        bufs = self._fp8_buffers()
        return None if bufs is None else fp8x.expert_states(self.fp8, *bufs, *self.fp8_queues())

    def fp8_buffers(self, prefix: str) -> dict[str, Shard]:
        """Delayed scaling's state by per-expert canonical name (layers/fp8_expert_gemm.py expert_fp8_shards)."""
        bufs = self._fp8_buffers()
        return fp8x.expert_fp8_shards(prefix, self.local, *bufs) if bufs is not None else {}

    def forward(self, x_mh: torch.Tensor, counts: list[int]) -> torch.Tensor:
        n = len(self.local)
        if self.fp8 is not None:
            return fp8x.experts_forward(x_mh, counts, self.up.view(n, 2 * self.f, self.h),
                                        self.down.view(n, self.h, self.f), self.fp8, self._fp8_states(),
                                        self.fp8_shards)
        # the device the GEMMs run on: a rehearsal's meta rows stand for a GPU's, and take its grouped GEMM
        method = choose_method(kernel_device(x_mh), x_mh.dtype, self.h, self.f)
        return expert_mlp(x_mh, counts, self.up.view(n, 2 * self.f, self.h), self.down.view(n, self.h, self.f),
                          method=method)

    def grad_specs(self) -> list[GradSpec]:
        """Split over tp, each rank's block is its own and complete (no tp sum, no replicas)."""
        return [GradSpec(self.up), GradSpec(self.down)] if self.split else []

    def canonical_shards(self, prefix: str) -> dict[str, Shard]:
        out = {}
        f, h, full, a = self.f, self.h, self.f_full, self.start
        for i, e in enumerate(self.local):
            up = self.up[i * 2 * f:(i + 1) * 2 * f]
            out[f"{prefix}.{e}.gate.weight"] = Shard(up[:f], (full, h), (a, 0))
            out[f"{prefix}.{e}.up.weight"] = Shard(up[f:], (full, h), (a, 0))
            out[f"{prefix}.{e}.down.weight"] = Shard(self.down[i * h:(i + 1) * h], (h, full), (0, a))
        return out


class MoE(nn.Module):
    """A sparse layer's MLP: routed experts (and shared experts, Qwen2-MoE's optionally gated)."""

    def __init__(self, cfg: ModelConfig, *, tp: TPContext | None = None, store: WeightGradStore | None = None,
                 linear: LinearKind = DEFAULT_LINEAR, device: DeviceLike = None,
                 dtype: torch.dtype | None = None, ep: EPContext | None = None) -> None:
        """``ep``: this rank holds ``ep.local_experts`` and exchanges tokens over ``ep.comm``; with
        ``tp``, ``ep.etp`` says whether experts are whole on every tp rank (1) or split over them (tp)."""
        super().__init__()
        ep = ep if ep is not None else EPContext()
        kw = {"device": device, "dtype": dtype}
        self.router = Router(cfg, **kw)
        self.tp = tp
        self.split = tp is not None and ep.etp > 1  # etp = tp: tokens gathered over tp, experts split
        local = ep.local_experts(cfg.num_experts)
        self.experts = Experts(cfg, local, tp if self.split else None, tokens=self.token_peers(tp, ep), **kw)
        self.dispatcher: TokenDispatcher = (build_dispatcher(ep.dispatcher, ep.comm, cfg.num_experts)
                                            if ep.comm is not None else LocalDispatcher(cfg.num_experts))
        if ep.size > 1:  # each expert's gradient: summed over its ep group's tokens, then over its replicas
            self.experts.grad_view = "expert_data"
        self.shared = None
        if cfg.shared_expert_ffn_size:
            self.shared = MLP(dataclasses.replace(cfg, ffn_hidden_size=cfg.shared_expert_ffn_size), tp=tp,
                              store=store, linear=linear, **kw)
        self.shared_gate = nn.Linear(cfg.hidden_size, 1, bias=False, **kw) if cfg.shared_expert_gate else None
        self.k, self.e = cfg.num_experts_per_tok, cfg.num_experts
        self.aux_coef, self.z_coef = cfg.router_aux_loss_coef, cfg.router_z_loss_coef
        self.capacity_factor = cfg.capacity_factor
        self.layer = -1  # the block's global layer index (``place``): the metrics' rows
        self.seq_comm: SeqGroup | None = None  # the ranks holding other parts of the same sequences
        self.loss_scale = 1.0  # the step's factor on every micro-batch loss (set_loss_scale)
        self.stats: RouterStats | None = None

    def place(self, layer: int, cp: CPContext | None) -> None:
        """Where the block sits: its global layer index, and the ranks that hold the rest of its
        sequences (the router losses are per whole sequence): cp's, and tp's under sequence parallelism
        when every tp rank routes its own chunk (etp = 1)."""
        self.layer = layer
        comms = [cp.comm] if cp is not None else []
        if self.tp is not None and self.tp.sequence_parallel and not self.split:
            comms.append(self.tp.comm)
        self.seq_comm = SeqGroup(tuple(comms)) if comms else None

    def token_peers(self, tp: TPContext | None, ep: EPContext) -> tuple[Comm, ...]:
        """The groups whose ranks hold the same experts and the rest of this rank's sequences: cp's ranks
        outside the ep group (``ep.token_peers``), and tp's under sequence parallelism with whole experts
        (each tp rank routes its own sequence chunk). Their rows together are one process's token block."""
        sp_chunks = tp is not None and tp.sequence_parallel and not self.split
        return tuple(c for c in (ep.token_peers, tp.comm if sp_chunks else None) if c is not None and c.size > 1)

    selective_recompute = True  # parallel.recompute=selective also recomputes the experts (Block.forward)

    def forward(self, x_sbh: torch.Tensor, recompute: bool = False) -> torch.Tensor:
        """``recompute``: keep only the dispatched rows of the experts and recompute their GEMMs and
        activation in backward (the k*T*(3f) elements per token that dominate an expert layer's memory)."""
        shared = self._shared(x_sbh)
        if self.split:  # etp = tp: every tp rank routes every token (identically), computes its ffn slice
            x_sbh = gather_input(x_sbh, self.tp)
        y_sbh = self._routed(x_sbh, recompute and self.training)
        if self.split:  # the slices' partial sums, back to this rank's sequence chunk under SP
            y_sbh = reduce_output(y_sbh, self.tp)
        return y_sbh if shared is None else y_sbh + shared

    def _shared(self, x_sbh: torch.Tensor) -> torch.Tensor | None:
        """The shared experts' output (a dense MLP: its own tp split), gated by sigmoid(gate(x)) for Qwen2-MoE."""
        if self.shared is None:
            return None
        out = self.shared(x_sbh)
        return out if self.shared_gate is None else torch.sigmoid(self.shared_gate(x_sbh)) * out

    def _routed(self, x_sbh: torch.Tensor, recompute: bool = False) -> torch.Tensor:
        s, b, h = x_sbh.shape
        x_th = x_sbh.reshape(s * b, h)
        weights_tk, experts_tk, probs_te, logits_te = self.router(x_th)
        routed_tk = experts_tk if self.capacity_factor is None else self._capacity(experts_tk)
        self._observe(experts_tk, routed_tk, probs_te, logits_te, s, b)
        x_mh, counts = self.dispatcher.dispatch(x_th, routed_tk)
        if recompute:  # delayed float8 scaling: the recompute replays the first forward's scales
            replay = recompute_contexts(self.experts)
            y_mh = torch.utils.checkpoint.checkpoint(self.experts, x_mh, counts, use_reentrant=False,
                                                     **({"context_fn": replay} if replay is not None else {}))
        else:
            y_mh = self.experts(x_mh, counts)
        slots = self.dispatcher.combine(y_mh).view(s * b, self.k, h)
        y_sbh = (slots.float() * weights_tk.unsqueeze(-1)).sum(1).to(x_sbh.dtype).view(s, b, h)
        aux = self._aux_loss(experts_tk, probs_te, logits_te, s, b)
        if aux is not None and self.training and torch.is_grad_enabled():
            # etp = tp: each tp rank's copy of the router reaches the loss (its gradients are summed over
            # tp, as are its input's): each gives 1/tp of the losses' gradient
            scale = self.loss_scale / (self.tp.size if self.split else 1)
            y_sbh = AddAuxGrad.apply(y_sbh, aux, scale)
        return y_sbh

    def _aux_loss(self, experts_tk: torch.Tensor, probs_te: torch.Tensor, logits_te: torch.Tensor,
                  s: int, b: int) -> torch.Tensor | None:
        """The micro-batch's coefficient-weighted router losses (per sequence, averaged over its b
        sequences), or None without coefficients."""
        if not (self.aux_coef or self.z_coef):
            return None
        out = torch.zeros((), device=probs_te.device)
        if self.aux_coef:
            out = out + self.aux_coef * balance_loss(experts_tk, probs_te, s, b, self.e, self.seq_comm)
        if self.z_coef:
            out = out + self.z_coef * z_loss(logits_te, self.seq_comm)
        return out

    @torch.no_grad()
    def _capacity(self, experts_tk: torch.Tensor) -> torch.Tensor:
        """Each expert takes at most ceil(capacity_factor * T * k / E) of this rank's slots, in GShard's
        order: every token's first choice by position, then every second choice, ...; the rest become
        ``E`` (dropped: not dispatched, their output zero; the token keeps its residual)."""
        t, k = experts_tk.shape
        cap = math.ceil(self.capacity_factor * t * k / self.e)
        order = experts_tk.t().reshape(-1)  # (choice, token) order
        onehot = F.one_hot(order, self.e)
        position = (onehot.cumsum(0) * onehot).sum(-1) - 1  # this slot's place in its expert's queue
        kept = torch.where(position < cap, order, torch.full_like(order, self.e))
        return kept.view(k, t).t()

    @torch.no_grad()
    def _observe(self, experts_tk: torch.Tensor, routed_tk: torch.Tensor, probs_te: torch.Tensor,
                 logits_te: torch.Tensor, s: int, b: int) -> None:
        """Accumulate the step's statistics (tokens each expert processed, slots dropped, the unweighted
        losses) on the device."""
        if not self.training or torch._C._current_graph_task_id() != -1:
            return  # evaluation, or a recompute inside backward (its forward was counted already)
        load = histogram(routed_tk.reshape(-1), self.e + 1).float()  # no host read (bincount reads its max)
        dropped, load = load[self.e], load[:self.e]
        if self.stats is None:
            z = torch.zeros((), device=load.device)
            self.stats = RouterStats(torch.zeros_like(load), z.clone(), z.clone(), z.clone())
        st = self.stats
        st.load += load
        st.dropped += dropped
        st.aux += balance_loss(experts_tk, probs_te, s, b, self.e, self.seq_comm)
        st.z += z_loss(logits_te, self.seq_comm)
        st.micro_batches += 1

    def take_stats(self) -> RouterStats | None:
        out, self.stats = self.stats, None
        return out

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor, rate: float) -> None:
        """Auxiliary-loss-free balancing (DeepSeek-V3): each expert's selection bias moves by ``rate``
        toward the mean load (up when under-loaded), from the step's global ``load``."""
        if self.router.bias is not None and rate:
            self.router.bias += rate * torch.sign(load.mean() - load)

    def parts(self) -> list[tuple[str, list[nn.Module]]]:
        first: list[nn.Module] = [self.router, self.experts]
        if self.shared is not None:
            first = [self.router, self.shared.up, self.experts]
        last: list[nn.Module] = [] if self.shared is None else [self.shared.down]
        if self.shared_gate is not None:
            last.append(self.shared_gate)
        return [("mlp_in", first)] + ([("mlp_out", last)] if last else [])

    def grad_specs(self) -> list[GradSpec]:
        """etp = tp: the router's gradient on each tp rank is partial (its weights multiply that rank's
        partial expert outputs): summed over tp. Otherwise the defaults (replicated; summed under SP)."""
        if not self.split:
            return []
        return [GradSpec(self.router.weight, None, self.tp.size, self.tp.comm)]

    def canonical_buffers(self, prefix: str) -> dict[str, Shard]:
        """State that is no parameter but must be saved: the selection bias (the same on every rank), the
        local experts' float8 delayed-scaling state."""
        out = {f"{prefix}.router.bias": Shard.full(self.router.bias)} if self.router.bias is not None else {}
        return {**out, **self.experts.fp8_buffers(f"{prefix}.experts")}  # float8 delayed scaling's state

    def canonical_shards(self, prefix: str) -> dict[str, Shard]:
        out = {f"{prefix}.router.weight": Shard.full(self.router.weight)}
        out.update(self.experts.canonical_shards(f"{prefix}.experts"))
        if self.shared is not None:
            out.update(self.shared.canonical_shards(f"{prefix}.shared"))
        if self.shared_gate is not None:
            out.update(param_shards(f"{prefix}.shared_gate", self.shared_gate))
        return out


@dataclasses.dataclass(frozen=True)
class SeqGroup:
    """The groups whose ranks hold other positions of the same sequences (cp; tp under SP), summed in turn."""

    comms: tuple[Comm, ...]

    @property
    def size(self) -> int:
        return math.prod(c.size for c in self.comms)

    def all_reduce(self, t: torch.Tensor) -> None:
        for c in self.comms:
            c.all_reduce(t)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """Differentiable: backward passes the gradient through unchanged. Every such rank computes the
        same loss from the sum and gives it the same gradient, so each local term gets it exactly once
        (Megatron's reduce-from-region)."""
        for c in self.comms:
            t = reduce_from_region(t, c)
        return t


def _seq_sum(t: torch.Tensor, comm: SeqGroup | None) -> torch.Tensor:
    return t if comm is None else comm.sum(t)


def balance_loss(experts_tk: torch.Tensor, probs_te: torch.Tensor, s: int, b: int, e: int,
                 comm: SeqGroup | None = None) -> torch.Tensor:
    """Mean over the b sequences of E * sum_i f_i P_i, each over its whole sequence (``comm``: the cp
    ranks holding its other positions; s is this rank's count): f_i the share of its k*S choices on
    expert i (no gradient), P_i its mean probability for expert i."""
    k = experts_tk.shape[1]
    with torch.no_grad():
        choices = torch.zeros(b, e, device=probs_te.device)
        per_seq = experts_tk.view(s, b, k).permute(1, 0, 2).reshape(b, s * k)
        choices.scatter_add_(1, per_seq, torch.ones(b, s * k, device=probs_te.device))
        n = float(s)  # a host number: torch.tensor(s, device=cuda) would be a synchronising copy
        if comm is not None:
            comm.all_reduce(choices)
            n = n * comm.size
    f = choices / (n * k)  # [b, E]
    p = _seq_sum(probs_te.view(s, b, e).sum(0), comm) / n
    return e * (f * p).sum(-1).mean()


def z_loss(logits_te: torch.Tensor, comm: SeqGroup | None = None) -> torch.Tensor:
    """Mean over the micro-batch's tokens (every cp rank's) of logsumexp(logits)^2 (ST-MoE), in fp32."""
    z = torch.logsumexp(logits_te.float(), dim=-1).square()
    count = z.numel() * (comm.size if comm is not None else 1)
    return _seq_sum(z.sum(), comm) / count


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def set_loss_scale(model: nn.Module, scale: float) -> None:
    """The factor the step puts on each micro-batch's loss (loss scale / micro-batches): the router
    losses' gradients carry it too."""
    for m in moe_layers(model):
        m.loss_scale = scale
