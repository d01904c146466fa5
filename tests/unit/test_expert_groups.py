"""Expert-parallel groups carved from dp x cp (core/topology.py expert_groups), checked against Megatron's
rule written out by hand, and the layout's ep keys in the one validator."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from mpformer.core.errors import ConfigError
from mpformer.core.layout import ParallelLayout, validate
from mpformer.core.model_config import ModelConfig
from mpformer.core.topology import MESH_VIEWS, Topology, expert_groups

COMBOS = [  # tp, cp, dp, pp, ep
    (1, 1, 4, 1, 2), (1, 1, 4, 1, 4), (1, 1, 4, 1, 1), (1, 2, 2, 1, 2), (2, 2, 2, 1, 4), (2, 1, 4, 2, 2),
    (1, 3, 2, 2, 3), (2, 2, 3, 1, 6), (1, 2, 4, 1, 8), (4, 1, 2, 1, 2),
]


def _megatron(topo: Topology, ep: int) -> tuple[set, set]:
    """By hand: d = cp_rank + cp * dp_rank within each (tp, pp) slice; ep_rank = d % ep, edp_rank = d // ep."""
    eps: dict = {}
    edps: dict = {}
    for r in range(topo.world_size):
        c = topo.coords(r)
        d = c["cp"] + topo.cp * c["dp"]
        eps.setdefault((c["tp"], c["pp"], d // ep), []).append(r)
        edps.setdefault((c["tp"], c["pp"], d % ep), []).append(r)
    return ({tuple(sorted(g)) for g in eps.values()}, {tuple(sorted(g)) for g in edps.values()})


@pytest.mark.parametrize("tp,cp,dp,pp,ep", COMBOS)
def test_expert_groups_partition_each_slice(tp, cp, dp, pp, ep):
    topo = Topology(tp=tp, cp=cp, dp=dp, pp=pp)
    ep_groups, edp_groups = expert_groups(topo, ep)
    assert ep_groups == sorted(ep_groups) and all(g == sorted(g) for g in ep_groups + edp_groups)
    for groups, size in ((ep_groups, ep), (edp_groups, dp * cp // ep)):
        assert sorted(r for g in groups for r in g) == list(range(topo.world_size))  # each rank exactly once
        assert all(len(g) == size for g in groups)
    assert len(ep_groups[0]) * len(edp_groups[0]) == dp * cp
    for g in ep_groups + edp_groups:  # tp and pp fixed within a group
        assert len({(topo.coords(r)["tp"], topo.coords(r)["pp"]) for r in g}) == 1
    for e, f in itertools.product(ep_groups, edp_groups):  # an ep group and an edp group meet at most once
        assert len(set(e) & set(f)) <= 1
    assert ({tuple(g) for g in ep_groups}, {tuple(g) for g in edp_groups}) == _megatron(topo, ep)


@pytest.mark.parametrize("tp,cp,dp,pp,ep", [*COMBOS, (1, 4, 1, 1, 2), (1, 4, 2, 1, 2), (2, 4, 1, 1, 1)])
def test_expert_cp_view_is_the_same_experts_within_a_cp_group(tp, cp, dp, pp, ep):
    """By hand: where ep divides cp, the ranks with this rank's tp, pp, dp and ep rank (d % ep); else itself."""
    topo = Topology(tp=tp, cp=cp, dp=dp, pp=pp)
    layout = ParallelLayout(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep)
    got = {tuple(g) for g in MESH_VIEWS["expert_cp"].rank_lists(topo, layout)}
    want: dict = {}
    for r in range(topo.world_size):
        c = topo.coords(r)
        d = c["cp"] + cp * c["dp"]
        key = (c["tp"], c["pp"], c["dp"], d % ep) if cp % ep == 0 else r
        want.setdefault(key, []).append(r)
    assert got == {tuple(sorted(g)) for g in want.values()}


def test_expert_groups_examples():
    assert expert_groups(Topology(dp=4), 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    # cp fastest inside d: ranks 0,1 are one replica's cp pair and form one ep group
    assert expert_groups(Topology(cp=2, dp=2), 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert expert_groups(Topology(tp=2, dp=2), 2) == ([[0, 2], [1, 3]], [[0], [1], [2], [3]])
    assert expert_groups(Topology(dp=4), 1) == ([[0], [1], [2], [3]], [[0, 1, 2, 3]])


def test_ep_must_divide_dp_times_cp():
    with pytest.raises(ValueError, match=r"parallel.ep=3 must divide dp\*cp = 4 .*valid: 1, 2, 4") as e:
        expert_groups(Topology(dp=2, cp=2), 3)
    assert "\n" not in str(e.value)


def test_views_are_registered_and_divide_like_the_data_view():
    topo = Topology(tp=2, cp=2, dp=3)
    assert {"data", "ep", "expert_data"} <= set(MESH_VIEWS)
    assert MESH_VIEWS["expert_data"].replicas(topo) == MESH_VIEWS["data"].replicas(topo) == 3
    layout = ParallelLayout(tp=2, cp=2, dp=3, ep=3)
    assert MESH_VIEWS["ep"].rank_lists(topo, layout) == expert_groups(topo, 3)[0]
    assert MESH_VIEWS["data"].rank_lists(topo, layout) == topo.groups("dp", "cp")


MOE = ModelConfig(arch="mixtral", num_layers=2, hidden_size=64, num_attention_heads=8, num_kv_heads=2,
                  ffn_hidden_size=128, vocab_size=100, num_experts=8, mlp_kind="moe")


def _err(layout: ParallelLayout, world: int, model: ModelConfig = MOE) -> str:
    with pytest.raises(ConfigError) as e:
        validate(layout, model, world)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_layout_ep_keys():
    assert validate(ParallelLayout(ep=2, cp=2), MOE, 4).dp == 2
    assert validate(ParallelLayout(ep=4, ep_dispatcher="allgather"), MOE, 4).ep == 4
    assert validate(ParallelLayout(tp=2, etp=2), MOE, 2).etp == 2
    msg = _err(ParallelLayout(ep=4, dp=2), 2)
    assert "parallel.ep=4 must divide dp*cp = 2*1 = 2" in msg and "valid ep: 1, 2" in msg
    assert "parallel.ep=0" in _err(ParallelLayout(ep=0), 1)
    msg = _err(ParallelLayout(ep_dispatcher="deepep"), 1)
    assert "parallel.ep_dispatcher='deepep'" in msg and "alltoall" in msg and "allgather" in msg
    assert "parallel.etp=0" in _err(ParallelLayout(etp=0), 1)
    assert validate(ParallelLayout(tp=2, etp=1), MOE, 2).etp == 1
    assert "valid: null (tp), 1, 2" in _err(ParallelLayout(tp=2, etp=4), 2)
    assert "parallel.etp=2" in _err(ParallelLayout(tp=2), 2, dataclasses.replace(MOE, moe_ffn_hidden_size=33))
    msg = _err(ParallelLayout(ep=3, dp=3), 3)
    assert "parallel.ep=3 does not divide model.num_experts=8" in msg and "1, 2, 4, 8" in msg
    dense = ModelConfig(arch="llama", num_layers=2, hidden_size=64, num_attention_heads=8, num_kv_heads=2,
                        ffn_hidden_size=128, vocab_size=100)
    assert "the model has none" in _err(ParallelLayout(ep=2), 2, dense)
