"""ParallelState: rank order tp-fastest, every group's members, and bad degrees."""

import pytest
import torch
import torch.distributed as dist

from mpcore.parallel.random import model_parallel_seed
from mpcore.parallel.state import ParallelState, group_size
from tests.dist.harness import run_distributed


def _members(group):
    ranks = torch.zeros(group_size(group), dtype=torch.int64)
    mine = torch.tensor([dist.get_rank()])
    out = [torch.zeros_like(mine) for _ in range(group_size(group))]
    dist.all_gather(out, mine, group=group)
    ranks[:] = torch.cat(out)
    return sorted(ranks.tolist())


def _layout(rank, world, tp, cp):
    s = ParallelState.build(tp=tp, cp=cp)
    assert rank == s.tp_rank + tp * (s.cp_rank + cp * s.dp_rank)
    return {name: _members(s.groups[name]) for name in ("tp", "cp", "dp", "dp_cp", "tp_cp")}


@pytest.mark.slow
def test_groups_tp2_cp2_dp2():
    got = run_distributed(_layout, 8, 2, 2)
    # rank = tp_rank + 2 * (cp_rank + 2 * dp_rank)
    assert got[5] == {"tp": [4, 5], "cp": [5, 7], "dp": [1, 5], "dp_cp": [1, 3, 5, 7],
                      "tp_cp": [4, 5, 6, 7]}
    assert got[0] == {"tp": [0, 1], "cp": [0, 2], "dp": [0, 4], "dp_cp": [0, 2, 4, 6],
                      "tp_cp": [0, 1, 2, 3]}


def _bad_degrees(rank, world):
    msgs = []
    for kwargs in (dict(tp=3), dict(tp=2, cp=1, dp=1), dict(tp=0)):
        try:
            ParallelState.build(**kwargs)
        except ValueError as e:
            msgs.append(str(e))
    return msgs


@pytest.mark.slow
def test_bad_degrees_raise_with_fix():
    msgs = run_distributed(_bad_degrees, 4)[0]
    assert len(msgs) == 3
    assert "world size 4 is not divisible by tp*cp" in msgs[0]
    assert "set dp=2" in msgs[1]
    assert "positive integer" in msgs[2]


def test_world_of_one_without_distributed():
    s = ParallelState.build()
    assert (s.tp, s.cp, s.dp, s.world_size, s.tp_group) == (1, 1, 1, 1, None)
    with pytest.raises(ValueError, match="not divisible"):
        ParallelState.build(tp=2)


def _dropout_streams(rank, world):
    s = ParallelState.build(tp=world)
    tracker = model_parallel_seed(1234, s.tp_rank)
    x = torch.ones(64)
    shared = torch.nn.functional.dropout(x, 0.5)
    with tracker.fork("tp"):
        sharded = torch.nn.functional.dropout(x, 0.5)
    after = torch.rand(4)  # the default stream continues as if the fork never happened
    return shared, sharded, after


def test_rng_tracker_differs_per_tp_rank_only_inside_fork():
    (s0, d0, a0), (s1, d1, a1) = run_distributed(_dropout_streams, 2)
    assert torch.equal(s0, s1) and torch.equal(a0, a1)
    assert not torch.equal(d0, d1)
    torch.manual_seed(1234)
    torch.nn.functional.dropout(torch.ones(64), 0.5)
    assert torch.equal(torch.rand(4), a0)


def _ep_layout(rank, world, tp, cp, ep):
    s = ParallelState.build(tp=tp, cp=cp, ep=ep)
    assert s.ep_rank == s.dp_cp_rank % ep and s.edp_rank == s.dp_cp_rank // ep
    return {name: _members(s.groups[name]) for name in ("ep", "edp")}


def test_ep_groups_share_dp_cp_with_ep_fastest():
    # tp=1, cp=2, dp=2: dp_cp index j = rank; ep groups are neighbours, edp the strided rest.
    got = run_distributed(_ep_layout, 4, 1, 2, 2)
    assert [g["ep"] for g in got] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [g["edp"] for g in got] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    # tp=2, dp=2: an ep group holds one tp rank of each dp replica; edp is a single rank.
    got = run_distributed(_ep_layout, 4, 2, 1, 2)
    assert [g["ep"] for g in got] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [g["edp"] for g in got] == [[0], [1], [2], [3]]


def test_ep_that_does_not_divide_dp_cp_raises():
    with pytest.raises(ValueError, match="ep = 3 must be a positive integer dividing dp\\*cp"):
        ParallelState.build(ep=3)
    assert ParallelState.build().ep_group is None and ParallelState().edp == 1


def _pp_layout(rank, world, tp, cp, pp, ep):
    s = ParallelState.build(tp=tp, cp=cp, pp=pp, ep=ep)
    assert rank == s.tp_rank + tp * (s.cp_rank + cp * (s.dp_rank + s.dp * s.pp_rank))
    names = ("tp", "cp", "dp", "dp_cp", "tp_cp", "pp") + (("ep", "edp") if ep > 1 else ())
    return {name: _members(s.groups[name]) for name in names}


def test_pp_is_slowest_and_every_other_group_stays_in_its_stage():
    # tp=2, pp=2 over 4: rank = tp_rank + 2 * pp_rank
    got = run_distributed(_pp_layout, 4, 2, 1, 2, 1)
    assert [g["pp"] for g in got] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [g["tp"] for g in got] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [g["dp_cp"] for g in got] == [[0], [1], [2], [3]]
    # cp=1, dp=2, pp=2, ep=2: rank = dp_rank + 2 * pp_rank; ep groups are a stage's dp ranks
    got = run_distributed(_pp_layout, 4, 1, 1, 2, 2)
    assert [g["pp"] for g in got] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [g["dp"] for g in got] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [g["ep"] for g in got] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [g["tp_cp"] for g in got] == [[0], [1], [2], [3]]


def test_pp_that_does_not_divide_the_world_raises():
    with pytest.raises(ValueError, match=r"tp\*cp\*pp = 1\*1\*2 = 2"):
        ParallelState.build(pp=2)
    s = ParallelState.build()
    assert (s.pp, s.pp_rank, s.pp_group) == (1, 0, None)
