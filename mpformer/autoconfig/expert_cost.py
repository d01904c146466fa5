"""Mixture of experts in the cost model: a sparse layer's GEMMs at their real shapes, and its token exchange.

GEMMs (kernels.py ``layer_work`` with ``kind="moe"``), per micro-batch on one rank, T the tokens it
routes (expert_memory.py ``routed_tokens``), k slots a token, E experts, E_l = E / ep on the rank,
f_e = f / etp:

    router        [T, h] x [h, E]
    experts       E_l GEMMs (one grouped call, ``batch`` = E_l) of T k ep / E rows each, the tokens the
                  ep group's ranks send one expert on average: [T k ep / E, h] x [h, 2 f_e] and
                  [T k ep / E, f_e] x [f_e, h]. Small and skinny at large E: the kernel model's tile and
                  wave quantisation (compute.py ``wave_efficiency``) prices them as they run
    shared        the shared experts as a dense MLP of the block's positions (tp-split)

Exchange (``dispatch_time``), per layer and micro-batch, forward and backward:

    alltoall      dispatch and combine in forward, their duals in backward: 4 all-to-alls of T k h
                  elements, (ep - 1) / ep of each leaving the rank (links.py ``_collective``)
    allgather     per pass an all-gather of the ep group's tokens (ep T h) and a reduce-scatter of its
                  slots (ep T k h): the dispatch's and the combine's, twice
    recompute     full recompute runs the forward's two exchanges again

In the pipeline they are not tensor-parallel waits: each stage's sparse layers give its F and B
exchanges (``stage_exchanges``, Costs.a2a_f / a2a_b), which a compute alone waits for and DualPipeV's
overlapped pairs run beside the other half's compute (pipeline/simulate.py).

The ep group is carved from dp x cp (core/topology.py): its ranks are tp apart in rank order, so it
spans tp x ep consecutive devices and leaves the node when they exceed the node's devices, where it
runs at the inter-node link's rate. The experts' gradients reduce over the expert-data group (dp cp /
ep ranks; ``dp_share``).
"""

from __future__ import annotations

from dataclasses import replace

from mpformer.autoconfig.cluster import Cluster
from mpformer.autoconfig.expert_memory import expert_data_size, expert_tp, routed_tokens
from mpformer.autoconfig.links import _collective
from mpformer.core.layout import ParallelLayout
from mpformer.core.model_config import ModelConfig


def moe_gemms(m: ModelConfig, L: ParallelLayout, seq_length: int, micro_batch: int) -> list[tuple[int, int, int, int]]:
    """A sparse layer's forward GEMMs on one rank as (rows, out, in, batch) (module docstring)."""
    h, k, E = m.hidden_size, m.num_experts_per_tok, m.num_experts
    t_r = routed_tokens(m, L, seq_length, micro_batch)
    local, f_e = E // L.ep, m.expert_ffn_size // expert_tp(L)
    rows = max(1, round(t_r * k * L.ep / E))
    out = [(int(t_r), E, h, 1), (rows, 2 * f_e, h, local), (rows, h, f_e, local)]
    fs = m.shared_expert_ffn_size
    if fs:
        tokens = seq_length // L.cp * micro_batch
        out += [(tokens, 2 * fs // L.tp, h, 1), (tokens, h, fs // L.tp, 1)]
    return out


def ep_spans_nodes(L: ParallelLayout, c: Cluster) -> bool:
    """Whether the ep group's ranks (tp apart, tp x ep consecutive devices) leave one node."""
    return L.tp * L.ep > c.devices_per_node


def dispatch_time(m: ModelConfig, L: ParallelLayout, seq_length: int, micro_batch: int, wb: int,
                  c: Cluster) -> float:
    """Seconds of one sparse layer's token exchanges per micro-batch, forward and backward together."""
    return sum(dispatch_times(m, L, seq_length, micro_batch, wb, c))


def dispatch_times(m: ModelConfig, L: ParallelLayout, seq_length: int, micro_batch: int, wb: int,
                   c: Cluster) -> tuple[float, float]:
    """(forward, backward) seconds of one sparse layer's token exchanges per micro-batch: the
    all-to-all dispatcher's dispatch and combine in forward, their duals in backward (2 and 2); the
    all-gather one's all-gather + reduce-scatter once each way; full recompute runs the forward's
    again in the backward (the pipeline's F and B carry them: Costs.a2a_f / a2a_b)."""
    if L.ep == 1:
        return 0.0, 0.0
    h, k, ep = m.hidden_size, m.num_experts_per_tok, L.ep
    t_r = routed_tokens(m, L, seq_length, micro_batch)
    spans = ep_spans_nodes(L, c)
    if L.ep_dispatcher == "allgather":
        one = (_collective(c, "all_gather", ep * t_r * h * wb, ep, spans)
               + _collective(c, "reduce_scatter", ep * t_r * k * h * wb, ep, spans))
        fwd = 1
    else:
        one = _collective(c, "all_to_all", t_r * k * h * wb, ep, spans)
        fwd = 2
    return fwd * one, (2 * fwd if L.recompute == "full" else fwd) * one


def stage_exchanges(m: ModelConfig, L: ParallelLayout, seq_length: int, micro_batch: int, wb: int, c: Cluster,
                    counts: list[int]) -> tuple[list[float], list[float]]:
    """Per (chunk) stage of ``counts`` layers in order: its sparse layers' exchanges per micro-batch,
    (forward, backward) lists; a layer past ``recompute_layers`` of its chunk runs without recompute."""
    fwd, bwd = [0.0] * len(counts), [0.0] * len(counts)
    if L.ep == 1:
        return fwd, bwd
    plain = replace(L, recompute="none", recompute_layers=None)
    start = 0
    for i, n in enumerate(counts):
        for j in range(start, start + n):
            if m.layer_mlp_kind(j) == "moe":
                lay = L if L.recompute_layers is None or j - start < L.recompute_layers else plain
                x_f, x_b = dispatch_times(m, lay, seq_length, micro_batch, wb, c)
                fwd[i], bwd[i] = fwd[i] + x_f, bwd[i] + x_b
        start += n
    return fwd, bwd


def dp_share(L: ParallelLayout, params: int, expert: int) -> float:
    """Parameters to price the data-parallel reduction at, over dp x cp ranks, when ``expert`` of the rank's
    ``params`` reduce over the expert-data group instead: a ring moves (n - 1) / n of its buffer, so each
    expert parameter weighs (n_e - 1) / n_e against (n_d - 1) / n_d."""
    n_d, n_e = L.dp * L.cp, expert_data_size(L)
    if n_d <= 1 or not expert:
        return float(params)
    return params - expert + expert * ((n_e - 1) / n_e) / ((n_d - 1) / n_d)
