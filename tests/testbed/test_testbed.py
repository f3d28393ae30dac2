"""The multi-process test bed fails fast, with every rank's story, on an error or a hang; its rank pools put every
rank back between runs, and a run that fails or leaves state behind gets new interpreters after it."""

import time

import pytest

from accel_fp8_fix.testing import DistributedTestError, run_distributed
from accel_fp8_fix.testing.pool import RankPool
from accel_fp8_fix.testing.shared import once_per_run, run_dir


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


# -- rank pools (accel_fp8_fix.testing.pool) -------------------------------------------------------------------
def _pid_and_state(rank, world_size, set_env=False):
    """What a pooled run can see of the runs before it: its process, the environment, accelerate's state, the
    patch set, the collectives recorded for this run."""
    import os

    import torch

    drawn = float(torch.rand(1))  # before any first import of this run (an import may draw from the RNG)
    import torch.distributed as dist

    import accel_fp8_fix
    from accelerate.state import PartialState
    from accel_fp8_fix.diagnostics import collective_order

    seen = {"pid": os.getpid(), "leftover_env": os.environ.get("ACCEL_FP8_FIX_TESTBED_PROBE"),
            "partial_state": bool(PartialState._shared_state), "patch_set": accel_fp8_fix.report().patch_set,
            "random": drawn, "recorded_before": len(collective_order._installed["recorder"].records)}
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    seen["sum"] = float(t)
    if set_env:
        os.environ["ACCEL_FP8_FIX_TESTBED_PROBE"] = "left by the previous run"
        PartialState(cpu=True)  # accelerate's singleton, over the run's default group
    return seen


def _leaves_a_patch(rank, world_size):
    import torch.nn.functional as F

    F.gelu = lambda x: x  # noqa: E731  (never restored: the pool must notice)
    return rank


def _leaves_a_thread(rank, world_size):
    import threading

    threading.Thread(target=threading.Event().wait, name="left-running", daemon=True).start()
    return rank


def test_a_pool_runs_many_launches_in_the_same_interpreters_each_as_a_fresh_one_would():
    # (forked ranks, the default; CI's torch 2.11 run of tests/distributed starts them anew: POOL_FORK=0)
    with RankPool(2, env={"ACCEL_FP8_FIX": "1"}) as pool:
        first = pool.run(_pid_and_state, args=(True,), timeout=120)
        second = pool.run(_pid_and_state, timeout=60)
        assert pool.starts == 1
    fresh = run_distributed(_pid_and_state, 2, env={"ACCEL_FP8_FIX": "1"}, timeout=120)
    assert [s["pid"] for s in first] == [s["pid"] for s in second]  # the same processes
    for before, after, new in zip(first, second, fresh):
        assert after["sum"] == 3.0 and after["recorded_before"] == 0  # a fresh group, a fresh audit per run
        assert after["leftover_env"] is None and not after["partial_state"]  # env and accelerate's state put back
        assert after["patch_set"] == before["patch_set"] == new["patch_set"] == "accelerate-1.13-1.16"  # re-applied
        assert after["random"] == before["random"]  # torch's RNG put back to its start-up state
        # (not compared with the fresh run: torch >= 2.13 seeds each new process's default generator at random)


def _process_and_generators(rank, world_size, exit_code=None):
    import os
    import random

    import numpy
    import torch

    if exit_code is not None and rank == 1:
        os._exit(exit_code)  # dies without a word: the pool reads its exit status
    return {"pid": os.getpid(), "parent": os.getppid(), "torch": float(torch.rand(1)),
            "numpy": float(numpy.random.rand()), "random": random.random()}


def test_a_forked_pools_ranks_are_processes_of_their_own_with_their_own_generators():
    """The start-up interpreter imports once and forks the ranks: each is its own process (its parent the start-up
    interpreter, not pytest), and draws from generators of its own as a started rank does — not from a copy shared
    by every rank."""
    import os

    with RankPool(2, env={"ACCEL_FP8_FIX": "0"}, preload=("torch", "numpy"), fork=True) as pool:
        forked = pool.run(_process_and_generators, timeout=60)
        zygote = pool._zygote.pid
        with pytest.raises(DistributedTestError, match=r"--- rank 1: the rank died \(exit 3\) ---"):
            pool.run(_process_and_generators, args=(3,), timeout=60)
    started = run_distributed(_process_and_generators, 2, env={"ACCEL_FP8_FIX": "0"}, timeout=60)
    assert forked[0]["pid"] != forked[1]["pid"] and {r["parent"] for r in forked} == {zygote} != {os.getpid()}
    for name in ("torch", "numpy", "random"):
        assert (forked[0][name] != forked[1][name]) == (started[0][name] != started[1][name]), name
    assert forked[0]["numpy"] != forked[1]["numpy"] and forked[0]["random"] != forked[1]["random"]


def test_a_forked_pool_whose_imports_fail_says_so_with_the_start_up_interpreters_output():
    with pytest.raises(DistributedTestError) as info:
        with RankPool(2, preload=("accel_fp8_fix_no_such_module",), start_timeout=60, fork=True) as pool:
            pool.run(_ranks_report, timeout=30)
    message = str(info.value)
    assert "start-up interpreter exited" in message and "--- start-up interpreter ---" in message
    assert "No module named 'accel_fp8_fix_no_such_module'" in message


def test_a_run_that_leaves_a_patch_or_a_thread_fails_naming_it_and_the_pool_is_rebuilt():
    with RankPool(2, env={"ACCEL_FP8_FIX": "0"}) as pool:
        assert pool.run(_ranks_report, timeout=120) == [(0, 2, 3.0), (1, 2, 3.0)]
        with pytest.raises(DistributedTestError, match=r"rank 0: left state behind: torch\.nn\.functional\.gelu "
                                                       r"replaced and not restored"):
            pool.run(_leaves_a_patch, timeout=60)
        assert pool.run(_ranks_report, timeout=120) == [(0, 2, 3.0), (1, 2, 3.0)]  # new interpreters
        with pytest.raises(DistributedTestError, match=r"thread 'left-running' \(daemon=True\) still running"):
            pool.run(_leaves_a_thread, timeout=60)
        assert pool.run(_ranks_report, timeout=120) == [(0, 2, 3.0), (1, 2, 3.0)]
        assert pool.starts == 3


def test_a_pooled_error_or_hang_fails_fast_with_every_ranks_report_and_the_pool_is_rebuilt():
    with RankPool(2, env={"ACCEL_FP8_FIX": "0"}) as pool:
        pool.run(_ranks_report, timeout=120)
        start = time.monotonic()
        with pytest.raises(DistributedTestError) as info:
            pool.run(_rank_one_raises, timeout=120, collective_timeout=60)
        assert "--- rank 1: ValueError: boom on rank 1 ---" in str(info.value)
        assert "--- rank 0:" in str(info.value)  # the peer's story too
        assert time.monotonic() - start < 40
        start = time.monotonic()
        with pytest.raises(DistributedTestError) as info:
            pool.run(_rank_one_hangs, timeout=6, collective_timeout=120)  # a pool's ranks have started already
        assert "timed out after 6s" in str(info.value) and "in _rank_one_hangs" in str(info.value)
        assert time.monotonic() - start < 20
        assert pool.run(_ranks_report, timeout=120) == [(0, 2, 3.0), (1, 2, 3.0)]
        assert pool.starts == 3


def _dtensor_op_mesh(rank, world_size, shift_groups=0):
    """A DTensor op on a 2-D mesh made in this run: is the output's mesh this run's (and its groups live)?
    ``shift_groups`` extra groups first, so that this run's group names differ from an earlier run's."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    for _ in range(shift_groups):
        dist.new_group([0, 1])
    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("a", "b"))
    x = distribute_tensor(torch.ones(4, 4), mesh, [Replicate(), Replicate()])
    out = x + x
    return {"same_mesh": out.device_mesh is mesh, "value": float(out.to_local().sum())}


def test_a_pooled_run_never_gets_an_earlier_runs_mesh_back_from_dtensors_caches():
    """DTensor caches its sharding answers with the meshes in them, and DeviceMesh equality ignores process groups:
    without the pool clearing those caches between runs, a later run's equal mesh got a destroyed run's mesh back
    (its group names then resolve to nothing, or to another group of the new run: the model-zoo hang)."""
    with RankPool(2, env={"ACCEL_FP8_FIX": "0"}) as pool:
        first = pool.run(_dtensor_op_mesh, timeout=120)
        second = pool.run(_dtensor_op_mesh, args=(3,), timeout=120)
    assert [r["same_mesh"] for r in first] == [True, True]
    assert second == [{"same_mesh": True, "value": 32.0}] * 2


def _groups_and_threads(rank, world_size, groups):
    """Make and destroy ``groups`` sub-groups, keeping them referenced (as a DeviceMesh would); OS threads after."""
    import os

    import torch.distributed as dist

    kept = [dist.new_group(list(range(world_size))) for _ in range(groups)]
    for group in kept:
        dist.barrier(group=group)
    _KEPT.extend(kept)  # referenced past the run: their gloo threads stay
    return len(os.listdir("/proc/self/task"))


_KEPT: list = []


def test_a_pool_whose_ranks_gather_threads_is_closed_after_the_run_and_restarted():
    """Referenced gloo groups keep their threads after destroy_process_group: past max_threads the pool closes
    after the run (whose results still count) and the next run gets new ranks with few threads."""
    with RankPool(2, env={"ACCEL_FP8_FIX": "0"}) as pool:
        few = pool.run(_groups_and_threads, args=(0,), timeout=60)
        pool.max_threads = max(few) + 10
        many = pool.run(_groups_and_threads, args=(8,), timeout=60)  # 3 threads a group: over the limit
        assert min(many) > max(few) + 10 and pool.recycles == 1 and not pool.alive
        again = pool.run(_groups_and_threads, args=(0,), timeout=60)
        assert max(again) <= max(few) + 2 and pool.starts == 2, (few, many, again)


@once_per_run
def _drawn_once(seed, shape):
    """Stands for a one-process reference: the same on every rank of a run, so computed by one of them."""
    import os

    import torch
    import torch.distributed as dist

    if run_dir() is not None:
        with open(run_dir() / "computations", "a") as log:
            log.write(f"{seed}\n")
    torch.manual_seed(seed)
    return {"pid": os.getpid(), "values": torch.rand(shape), "group_seen": dist.is_initialized()}


def _shares_what_one_rank_computed(rank, world_size):
    import os

    import torch
    import torch.distributed as dist

    torch.manual_seed(100 + rank)
    before = torch.get_rng_state()
    first, again, other = _drawn_once(3, [2, 2]), _drawn_once(3, shape=[2, 2]), _drawn_once(4, (2, 2))
    rng_kept = torch.equal(torch.get_rng_state(), before)
    try:
        _drawn_once(3, torch.ones(2))
        refused = None
    except TypeError as exc:
        refused = str(exc)
    dist.barrier()
    return {"pid": os.getpid(), "first": first, "again": again, "other": other, "rng_kept": rng_kept,
            "refused": refused, "group": dist.is_initialized(),
            "computations": sorted((run_dir() / "computations").read_text().split())}


def test_what_every_rank_computes_alike_is_computed_by_one_and_read_by_the_others():
    """``once_per_run`` (tests/support's one-process references): one rank of the run computes, as one process
    (no process group visible, torch's generator put back), and every rank gets the stored result; pooled and
    fresh ranks alike. Outside a run it is a plain call."""
    import os

    import torch

    with RankPool(2, env={"ACCEL_FP8_FIX": "0"}) as pool:
        pooled = pool.run(_shares_what_one_rank_computed, timeout=60)
    fresh = run_distributed(_shares_what_one_rank_computed, 2, env={"ACCEL_FP8_FIX": "0"}, timeout=60)
    for ranks in (pooled, fresh):
        pids = {r["pid"] for r in ranks}
        for r in ranks:
            assert r["computations"] == ["3", "4"]  # once per key for the whole run, not once per rank
            assert r["first"]["pid"] in pids and r["first"]["pid"] == ranks[0]["first"]["pid"]
            assert torch.equal(r["first"]["values"], ranks[0]["first"]["values"])
            assert r["again"]["pid"] == r["first"]["pid"] and torch.equal(r["again"]["values"], r["first"]["values"])
            assert not torch.equal(r["other"]["values"], r["first"]["values"])
            assert r["group"] and not r["first"]["group_seen"]  # computed as in one process
            assert r["rng_kept"]
            assert "argument 'shape' is a Tensor" in r["refused"] and "plain data" in r["refused"]
    assert run_dir() is None and _drawn_once(3, [2])["pid"] == os.getpid()
