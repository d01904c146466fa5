"""Rank <-> coordinate math (order tp-cp-dp-pp, tp fastest), checked against a brute-force enumeration."""

import itertools

import pytest

from mpformer.core.topology import Topology


@pytest.mark.parametrize("tp,cp,dp,pp", [(1, 1, 1, 1), (2, 1, 2, 1), (2, 2, 2, 2), (4, 1, 2, 3), (1, 3, 1, 2)])
def test_rank_coords_roundtrip_and_order(tp, cp, dp, pp):
    topo = Topology(tp=tp, cp=cp, dp=dp, pp=pp)
    expected = {}
    r = 0
    for p, d, c, t in itertools.product(range(pp), range(dp), range(cp), range(tp)):  # tp fastest
        expected[r] = {"tp": t, "cp": c, "dp": d, "pp": p}
        r += 1
    assert topo.world_size == r
    for rank, coords in expected.items():
        assert topo.coords(rank) == coords
        assert topo.rank(**coords) == rank


def test_groups_partition_the_world():
    topo = Topology(tp=2, cp=1, dp=2, pp=2)
    for dims in [("tp",), ("dp",), ("pp",), ("cp",), ("dp", "cp"), ("tp", "dp")]:
        groups = topo.groups(*dims)
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(topo.world_size)), dims
    assert topo.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert topo.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.group_of(5, "dp") == [5, 7]


def test_bad_coordinates():
    topo = Topology(tp=2, dp=2)
    with pytest.raises(ValueError, match="rank 4"):
        topo.coords(4)
    with pytest.raises(ValueError, match="unknown dims"):
        topo.rank(xx=1)
    with pytest.raises(ValueError, match="tp coordinate"):
        topo.rank(tp=2)
    with pytest.raises(ValueError):
        Topology(tp=0)
