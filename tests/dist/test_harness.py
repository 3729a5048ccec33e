import time

import pytest
import torch
import torch.distributed as dist

from tests.dist.harness import run_distributed


def _sum_ranks(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def _fail_on_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank one")
    dist.barrier()


def _hang(rank, world_size):
    if rank == 0:
        dist.barrier()  # rank 1 never joins: it is stuck elsewhere
    else:
        time.sleep(600)


def test_results_by_rank():
    assert run_distributed(_sum_ranks, 3) == [3.0, 3.0, 3.0]


def test_exception_propagates_with_traceback():
    with pytest.raises(RuntimeError, match="boom on rank one"):
        run_distributed(_fail_on_one, 2, timeout=60)


@pytest.mark.slow
def test_hung_collective_times_out():
    with pytest.raises(TimeoutError, match="did not finish"):
        run_distributed(_hang, 2, timeout=3)
