"""The multi-process test bed fails fast, with every rank's story, on an error or a hang."""

import time

import pytest

from accel_fp8_fix.testing import DistributedTestError, run_distributed


def _ranks_report(rank, world_size):
    import torch
    import torch.distributed as dist

    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return rank, world_size, float(t)


def _rank_one_raises(rank, world_size):
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()  # rank 0 waits for a peer that is gone


def _rank_one_hangs(rank, world_size):
    import torch
    import torch.distributed as dist

    if rank == 1:
        time.sleep(600)
    dist.all_reduce(torch.ones(1))


def test_results_come_back_in_rank_order():
    assert run_distributed(_ranks_report, 3, timeout=60) == [(0, 3, 6.0), (1, 3, 6.0), (2, 3, 6.0)]


def test_an_error_on_one_rank_fails_fast_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_rank_one_raises, 2, timeout=120, collective_timeout=60)
    message = str(info.value)
    assert "--- rank 1: exit 1 ---" in message and "ValueError: boom on rank 1" in message
    assert time.monotonic() - start < 40  # not the 120 s deadline


def test_a_hang_is_killed_at_the_deadline_and_says_where_each_rank_waited():
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_rank_one_hangs, 2, timeout=15, collective_timeout=120)
    message = str(info.value)
    assert "timed out after 15s" in message
    assert "in _rank_one_hangs" in message  # faulthandler's dump of the waiting frame
    assert time.monotonic() - start < 30
