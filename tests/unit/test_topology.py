"""Topology: validation with clear errors, per-rank coordinates, group rank lists (no Ray, no torch.distributed)."""
import pytest

from parallel.topology import Topology, TopologyError


def test_coords_and_groups_tp2_dp2_ep4():
    t = Topology(world=4, tp=2, dp=2, ep=4)
    assert [(c.dp_rank, c.tp_rank, c.ep_rank) for c in map(t.coords, range(4))] == [(0, 0, 0), (0, 1, 1), (1, 0, 2),
                                                                                   (1, 1, 3)]
    assert t.tp_groups() == [[0, 1], [2, 3]]
    assert t.tp_group_of(3) == [2, 3]
    assert t.ep_group() == [0, 1, 2, 3]
    assert t.dp_leaders() == [0, 2]
    assert t.rank_of(1, 1) == 3
    assert t.ep_enabled and t.collectives_cross_dp


def test_no_ep_and_single_rank():
    t = Topology.of(tp=1, dp=3)
    assert t.world == 3 and t.ep_group() is None and t.coords(2).ep_rank == 0
    assert t.tp_groups() == [[0], [1], [2]] and not t.collectives_cross_dp
    one = Topology(world=1)
    assert one.coords(0).rank == 0 and one.dp_leaders() == [0]
    assert not Topology.of(tp=2, ep=2).collectives_cross_dp  # one DP group: EP stays inside it


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(world=4, tp=2, dp=1), "world size 4 != tp 2 \\* dp 1"),
        (dict(world=4, tp=2, dp=2, ep=2), "ep must be 1 .* or the world size 4"),
        (dict(world=2, tp=0, dp=2), "tp must be an int >= 1, got 0"),
        (dict(world=2, tp=2, dp=1.0), "dp must be an int"),
        (dict(world=2, tp=True, dp=2), "tp must be an int"),
    ],
)
def test_invalid_topologies_name_the_problem(kw, message):
    with pytest.raises(TopologyError, match=message):
        Topology(**kw)


def test_of_rejects_bad_sizes_and_ranks():
    with pytest.raises(TopologyError, match="dp must be an int >= 1, got -1"):
        Topology.of(tp=2, dp=-1)
    t = Topology.of(tp=2)
    with pytest.raises(TopologyError, match="rank 2 outside world size 2"):
        t.coords(2)
    with pytest.raises(TopologyError, match="outside dp 1 x tp 2"):
        t.rank_of(1, 0)
    with pytest.raises(Exception):
        t.tp = 4  # frozen
