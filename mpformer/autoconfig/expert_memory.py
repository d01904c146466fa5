"""Mixture of experts in the memory model: what a sparse layer (``layer_mlp_kind(i) == "moe"``) holds.

Parameters on one rank (core/layer_spec.py's MoE kind at the layout's ep and etp):

    dense part    the router [E, h] (whole on every tp rank) and the shared experts (tp-split, as the
                  dense MLP): reduced, and ZeRO-sharded, over dp x cp like every dense weight
    expert part   E / ep experts, each 3 f h / etp (gate, up, down split over etp = 1 or tp): reduced,
                  and ZeRO-sharded, over the expert-data-parallel group of dp x cp / ep ranks
                  (core/topology.py "expert_data"); the ZeRO table with N_d = dp cp / ep for them

Activations kept per micro-batch (layers/moe.py, op by op; ``wb`` the activation dtype's bytes):
T the tokens the rank routes (its s/cp positions x b; its sequence-parallel chunk when etp = 1,
every position of the tp group when etp = tp, whose gathered input is then kept too), k slots per
token, M = T k the rows its experts process (the mean over routings; capacity_factor < 1 cuts it
to cf T k), f_e = f / etp, E experts:

    router        its fp32 probabilities [T, E] (4 T E), the top-k weights (8 T k fp32, and 4 T
                  for their renormalisation), the chosen ids and the dispatch order and its
                  inverse (int64: 24 T k)
    dispatched    the rows sent to the experts, x_mh [M, h] (wb M h): the all-to-all's output, or the
                  rows kept of the all-gather
    experts       SwiGLU per expert: gate and up outputs, silu(gate), the product (4 wb M f_e); not
                  under selective recompute (its experts are recomputed from x_mh)
    combine       the k slots per token in fp32 for the weighted sum (4 T k h)
    shared        the shared experts as a dense SwiGLU MLP (4 wb T_s f_s / t), and with its gate the
                  gate's sigmoid (wb T_s) and the shared output (wb T_s h) it multiplies

Checked against autograd's saved tensors in tests/unit/test_memory_moe.py. The dispatch buffers (the
backward of one exchange, live while the layer's backward runs): the all-to-all's received gradient
rows (wb M h) and the slots' gradient (wb T k h); the all-gather dispatcher's gathered
[ep T k, h] rows of the combine (its backward all-gathers the slots' gradient) in place of the former.
"""

from __future__ import annotations

from collections.abc import Iterable

from mpformer.core.layer_spec import mlp_kind, moe_expert_params
from mpformer.core.layout import ParallelLayout
from mpformer.core.model_config import ModelConfig

MOE = "moe"


def expert_tp(L: ParallelLayout) -> int:
    """parallel.etp as it runs: null is tp."""
    return L.tp if L.etp is None else L.etp


def expert_data_size(L: ParallelLayout) -> int:
    """Ranks an expert's gradient reduces (and ZeRO shards its state) over: dp x cp / ep."""
    return L.dp * L.cp // L.ep


def mlp_part_sizes(m: ModelConfig, L: ParallelLayout, kind: str) -> list[list[int]]:
    """A layer's MLP parameters on one rank by part (``kind``: its ``layer_mlp_kind``)."""
    if kind == MOE:
        return mlp_kind(kind).part_sizes(m, L.tp, L.ep, expert_tp(L))
    return mlp_kind(kind).part_sizes(m, L.tp)


def expert_params(m: ModelConfig, L: ParallelLayout, kind: str) -> int:
    """Of a layer's parameters on one rank, those that reduce over the expert-data group."""
    return moe_expert_params(m, L.ep, expert_tp(L)) if kind == MOE else 0


def expert_param_sizes(m: ModelConfig, L: ParallelLayout, kind: str) -> tuple[int, ...]:
    """Element counts of a layer's routed-expert parameters on one rank (layers/moe.py Experts: gate|up
    [E/ep x 2f/etp, h], down [E/ep x h, f/etp]), as the engine buckets them apart; none for a dense MLP."""
    if kind != MOE:
        return ()
    e, f = m.num_experts // L.ep, m.expert_ffn_size // expert_tp(L)
    return (e * 2 * f * m.hidden_size, e * m.hidden_size * f)


def stage_expert_params(m: ModelConfig, L: ParallelLayout, layers: Iterable[int]) -> int:
    """The expert parameters of these (global) layers on one rank."""
    return sum(expert_params(m, L, m.layer_mlp_kind(i)) for i in layers)


def routed_tokens(m: ModelConfig, L: ParallelLayout, seq_length: int, micro_batch: int) -> float:
    """T: the tokens one rank routes per micro-batch (module docstring)."""
    s_n = seq_length / L.cp
    split = L.tp > 1 and L.sequence_parallel and expert_tp(L) == 1  # each tp rank routes its own chunk
    return (s_n / L.tp if split else s_n) * micro_batch


def expert_rows(m: ModelConfig, tokens: float) -> float:
    """M: the rows a rank's experts process per micro-batch, on average (capacity_factor < 1 bounds it)."""
    cf = m.capacity_factor
    return tokens * m.num_experts_per_tok * (min(cf, 1.0) if cf is not None else 1.0)


def moe_saved_bytes(m: ModelConfig, L: ParallelLayout, seq_length: int, micro_batch: int, wb: int,
                    mode: str) -> float:
    """What a sparse layer's MLP keeps for backward per micro-batch on one rank beyond the linear input
    the block counts (module docstring); ``mode``: the layer's recompute (full: nothing)."""
    if mode == "full":
        return 0.0
    k, h, E = m.num_experts_per_tok, m.hidden_size, m.num_experts
    t_r = routed_tokens(m, L, seq_length, micro_batch)
    rows, f_e = expert_rows(m, t_r), m.expert_ffn_size // expert_tp(L)
    router = 4 * t_r * E + 8 * t_r * k + (4 * t_r if m.norm_topk_prob and m.router_score == "softmax" else 0.0)
    router += 24 * t_r * k
    out = router + wb * rows * h + 4 * t_r * k * h
    if mode != "selective":
        out += 4 * wb * rows * f_e
    gathered = L.tp > 1 and L.sequence_parallel and expert_tp(L) > 1  # etp = tp: the gathered input kept
    if gathered:
        out += wb * t_r * h
    fs = m.shared_expert_ffn_size
    if fs:
        s_n = seq_length / L.cp * micro_batch  # the shared MLP runs on the block's positions (its own tp)
        out += 4 * wb * s_n * (fs // L.tp)
        if m.shared_expert_gate:
            t_s = s_n / (L.tp if L.sequence_parallel else 1)
            out += wb * t_s * (h + 1)
    return out


def moe_backward_bytes(m: ModelConfig, L: ParallelLayout, seq_length: int, micro_batch: int, wb: int) -> float:
    """Live above the kept bytes while a sparse layer's MLP runs its backward: the dispatch buffers
    (module docstring), one expert's SwiGLU gradients at a time (its rows' share, 2 wb (M / E_l) f_e) and
    the gate/up projection's weight gradient of every local expert at once (the grouped GEMM's dW,
    wb E_l 2 f_e h, formed before it is added into the main gradients; measured: Mixtral's widths at
    tp = etp = 2, cp 2 rehearsed 5.9% above the count without it)."""
    k, h = m.num_experts_per_tok, m.hidden_size
    t_r = routed_tokens(m, L, seq_length, micro_batch)
    rows, f_e = expert_rows(m, t_r), m.expert_ffn_size // expert_tp(L)
    local = m.num_experts // L.ep
    exchange = wb * t_r * k * h * (L.ep if L.ep > 1 and L.ep_dispatcher == "allgather" else 1) + wb * rows * h
    return exchange + 2 * wb * rows / local * f_e + wb * local * 2 * f_e * h


def dispatch_buffer_bytes(m: ModelConfig, L: ParallelLayout, seq_length: int, micro_batch: int, wb: int) -> float:
    """The largest buffer one exchange of a sparse layer allocates (the search reports it): the all-to-all's
    received rows (wb M h) or the all-gather dispatcher's combine, ep T k rows of h."""
    k, h = m.num_experts_per_tok, m.hidden_size
    t_r = routed_tokens(m, L, seq_length, micro_batch)
    if L.ep > 1 and L.ep_dispatcher == "allgather":
        return wb * L.ep * t_r * k * h
    return wb * expert_rows(m, t_r) * h
