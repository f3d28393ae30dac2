"""The collective-order audit of the test bed (accel_fp8_fix.diagnostics.collective_order): planted divergences — ones
gloo completes and NCCL would hang on or corrupt, and one gloo hangs on too — and a collective planted inside
FSDP2's all-gather extension hook fail the run by name; what FSDP2 and DTensor issue is recorded alike on every
rank."""

import pytest

from accel_fp8_fix.testing import DistributedTestError
from support import launcher


def _planted(rank, world_size, which):
    import torch
    import torch.distributed as dist

    if which == "dtype":  # same bytes, other dtype: gloo completes with garbage on rank 1
        t = torch.ones(4, dtype=torch.float32 if rank == 0 else torch.int32)
        dist.all_reduce(t)
        return str(t.dtype)
    if which == "order":  # two shared groups in opposite orders: gloo's async ops complete, NCCL deadlocks
        pair = dist.new_group([0, 1])
        a, b = torch.ones(3), torch.ones(3)
        first, second = ((a, pair), (b, None)) if rank == 0 else ((b, None), (a, pair))
        works = [dist.all_reduce(t, group=g, async_op=True) for t, g in (first, second) if rank < 2 or g is None]
        for w in works:
            w.wait()
        return float(b.sum())
    if which == "kind":  # all_reduce on rank 0, broadcast on rank 1: a hang, on gloo too
        t = torch.ones(4)
        dist.all_reduce(torch.ones(2))
        dist.all_reduce(t) if rank == 0 else dist.broadcast(t, src=0)
        return True
    raise ValueError(which)


def _in_hook(rank, world_size):
    """FSDP2 with an all-gather extension whose fsdp_pre_all_gather all-reduces (through the package's collectives,
    as the FP8 all-gather's weight amax once did): the ranks agree, gloo completes; on a GPU it would run on FSDP2's
    copy-in stream, between FSDP2's own collectives."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from accel_fp8_fix.distributed import collectives

    class Extended(torch.Tensor):
        __torch_function__ = torch._C._disabled_torch_function_impl

        def fsdp_pre_all_gather(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy):
            collectives.all_reduce(torch.ones(3), group=dist.group.WORLD, name="planted in the hook")
            return (self.as_subclass(torch.Tensor),), None

        def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
            if out is not None:
                return None
            return outputs[0], outputs

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6, bias=False), torch.nn.Linear(6, 2, bias=False))
    fully_shard(model[0], mesh=init_device_mesh("cpu", (world_size,)))
    for fsdp_param in model[0]._get_fsdp_state()._fsdp_param_group.fsdp_params:
        fsdp_param.sharded_param._local_tensor = fsdp_param.sharded_param._local_tensor.as_subclass(Extended)
        fsdp_param._init_extensions()
    return float(model(torch.ones(3, 6)).sum())


def _fsdp2_step(mesh):
    """Forward and backward of a two-layer model under FSDP2 (all-gathers, reduce-scatters)."""
    import torch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Linear(6, 2))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model(torch.ones(3, 6)).sum().backward()


def _records(rank, world_size, layout):
    """What the rank's recorder saw while FSDP2 / DTensor ran."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from accel_fp8_fix.diagnostics import collective_order

    recorder = collective_order._installed["recorder"]
    mesh = init_device_mesh("cpu", (world_size,))
    before = len(recorder.records)
    if layout == "dtensor":
        d = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
        assert d.full_tensor().shape == (4, 2)
    else:
        _fsdp2_step(mesh)
    dist.barrier()
    return [(r.kind, r.group, r.dtype, r.numel) for r in recorder.records[before:]]


def _both_views(rank, world_size):
    """The same window of collectives as the audit's flight-recorder trail and the dispatch-mode recorder see it:
    c10d's Python API (a subgroup, bf16, a reduce-scatter gloo runs as an all-reduce, objects), DTensor's
    redistributions (functional collectives; distribute_tensor scatters), an all-to-all, FSDP2's forward and backward."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from accel_fp8_fix.diagnostics import collective_order

    trail = collective_order._installed["recorder"]
    mesh = init_device_mesh("cpu", (world_size,))
    pair = dist.new_group([0, 1])
    before = len(trail.records)
    with collective_order.CollectiveRecorder() as dispatch:
        dist.all_reduce(torch.ones(5))
        dist.all_gather_into_tensor(torch.empty(6, dtype=torch.bfloat16), torch.ones(3, dtype=torch.bfloat16), group=pair)
        dist.reduce_scatter_tensor(torch.empty(2), torch.ones(2 * world_size))
        dist.broadcast(torch.ones(4, dtype=torch.int64), src=0)
        dist.all_gather_object([None] * world_size, {"rank": rank})
        dist.all_to_all_single(torch.empty(world_size), torch.ones(world_size))
        d = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
        d.redistribute(mesh, [Replicate()])
        p = DTensor.from_local(torch.ones(4, 2), mesh, [Partial()])
        p.redistribute(mesh, [Shard(0)])
        p.redistribute(mesh, [Replicate()])
        _fsdp2_step(mesh)
        dist.barrier()
    seen = {"trail": type(trail).__name__, "flight_recorder": [r.key() + (r.inside,) for r in trail.records[before:]],
            "dispatch": [r.key() + (r.inside,) for r in dispatch.records]}
    dist.destroy_process_group(pair)
    return seen


def test_the_flight_recorder_trail_records_what_the_dispatch_mode_records():
    """The audit reads c10d's flight recorder (no per-op cost); over the same collectives it must record exactly
    what the dispatch-mode recorder records — kind, group, name, dtype, count, in program order."""
    for seen in launcher.run(_both_views, 2, timeout=90):
        assert seen["trail"] == "FlightRecorderTrail"
        assert seen["flight_recorder"] == seen["dispatch"], (seen["flight_recorder"], seen["dispatch"])
        kinds = {key[0] for key in seen["dispatch"]}
        assert kinds == {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "scatter", "all_to_all", "barrier"}, kinds


def _group_names_reused(rank, world_size):
    """Two incarnations of the default group in one run (as fresh runs of several scenarios have): c10d numbers the
    second one's groups from 0 again, so one name means ranks [0, 1] first and [1, 2] after."""
    import os
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from accel_fp8_fix.testing import free_port

    first = dist.new_group([0, 1])
    if rank in (0, 1):
        dist.all_reduce(torch.ones(2), group=first)
    names = [first.group_name if rank in (0, 1) else None]
    port = [free_port() if rank == 0 else None]
    dist.broadcast_object_list(port, src=0)
    dist.barrier()
    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port[0])
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    second = dist.new_group([1, 2])
    if rank in (1, 2):
        dist.all_reduce(torch.ones(3), group=second)
        names.append(second.group_name)
    return names


def test_group_names_c10d_reuses_after_a_new_default_group_keep_their_own_ranks():
    names = launcher.run(_group_names_reused, 3, timeout=90)  # the audit passes: each record kept its group's ranks
    assert names[1][0] == names[1][1], names  # the same name, two groups: what the audit must tell apart


def _many_all_reduces(rank, world_size, count):
    import torch
    import torch.distributed as dist

    for _ in range(count):
        dist.all_reduce(torch.ones(2))
    return True


def test_a_run_that_outgrows_the_flight_recorder_fails_naming_its_variable():
    """Collectives the flight recorder dropped before the audit read them are never passed over in silence."""
    with pytest.raises(DistributedTestError, match=r"the flight recorder dropped \d+ collective\(s\) before they were "
                                                   r"read \(TORCH_FR_BUFFER_SIZE=8 is too small for this run\)"):
        launcher.run(_many_all_reduces, 2, args=(20,), env={"TORCH_FR_BUFFER_SIZE": "8"}, timeout=60)


def test_a_dtype_mismatch_gloo_completes_fails_the_run_naming_the_collective_and_ranks():
    # gloo alone: the run "passes", rank 1 holding garbage
    assert launcher.run(_planted, 2, args=("dtype",), timeout=60, audit_collectives=False) == ["torch.float32",
                                                                                                   "torch.int32"]
    with pytest.raises(DistributedTestError) as info:
        launcher.run(_planted, 2, args=("dtype",), timeout=60)
    text = str(info.value)
    assert "the ranks' collectives diverge (gloo completed the run; NCCL would hang or corrupt it)" in text
    assert ("group [0, 1]: collective #0 differs between ranks 0 and 1: rank 0 issued all_reduce (gloo:all_reduce) "
            "float32 numel=4 on group [0, 1]; rank 1 issued all_reduce (gloo:all_reduce) int32 numel=4") in text


def test_two_groups_in_opposite_orders_fail_the_run_though_each_group_agrees():
    assert launcher.run(_planted, 3, args=("order",), timeout=60, audit_collectives=False) == [9.0, 9.0, 9.0]
    with pytest.raises(DistributedTestError, match=r"ranks 0 and 1 issue their shared groups' collectives in a "
                                                   r"different order \(NCCL deadlocks\): shared collective #0"):
        launcher.run(_planted, 3, args=("order",), timeout=60)


def test_a_hang_reports_the_divergence_that_caused_it():
    with pytest.raises(DistributedTestError) as info:
        launcher.run(_planted, 2, args=("kind",), timeout=8)  # pooled: the deadline is the hang's, not a start-up's
    text = str(info.value)
    assert "timed out after 8s" in text
    assert ("collective #1 differs between ranks 0 and 1: rank 0 issued all_reduce (gloo:all_reduce) float32 numel=4"
            " on group [0, 1]; rank 1 issued broadcast (gloo:broadcast) float32 numel=4") in text


def test_a_collective_inside_fsdp2s_all_gather_extension_hook_fails_the_run_by_name():
    with pytest.raises(DistributedTestError) as info:
        launcher.run(_in_hook, 2, timeout=60)
    text = str(info.value)
    assert "collectives were issued inside FSDP2's all-gather extension hooks (gloo completed the run" in text
    for rank in (0, 1):
        assert (f"rank {rank} issued 1 collective(s) inside FSDP2's all-gather extension hooks, the first all_reduce "
                "(gloo:all_reduce) float32 numel=3 on group [0, 1] inside fsdp_pre_all_gather") in text
    assert info.value.results is not None and len(info.value.results) == 2  # it completed: only the audit objects


def test_dtensor_redistribution_and_fsdp2_collectives_are_recorded_alike_on_every_rank():
    dtensor = launcher.run(_records, 2, args=("dtensor",), timeout=90)
    # full_tensor() is an all-gather issued inside DTensor's dispatch: recorded as the plain-tensor functional op
    assert ("all_gather", (0, 1), "float32", 4) in dtensor[0]
    assert dtensor[0] == dtensor[1]
    fsdp = launcher.run(_records, 2, args=("fsdp2",), timeout=90)
    kinds = [k for k, *_ in fsdp[0]]
    assert kinds.count("all_gather") >= 2 and kinds.count("reduce_scatter") >= 2, fsdp[0]
    assert fsdp[0] == fsdp[1]
