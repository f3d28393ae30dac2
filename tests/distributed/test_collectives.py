"""accel_fp8_fix.distributed.collectives and accel_fp8_fix.testing.spy, on real gloo ranks.

Two launches: 2 ranks (1-D mesh: the seed error for real, the public family — broadcast, all_reduce,
broadcast_variable, broadcast_object, all_gather_object — refusals, variable size, objects, the spy) and
4 ranks (2x2 mesh: group_of, global <-> group rank translation, src translation, refusals on the sharded
dim, a flattened group that is not WORLD).
"""

from __future__ import annotations

import io
import pickle

import pytest
import torch

from support import launcher


SEED_ERRORS = ("does not have a sharding strategy registered", "found no DeviceMesh from dtensor args")


def _raises(fn, *needles):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        text = f"{type(exc).__name__}: {exc}"
        assert any(n in text for n in needles), text
        return text
    raise AssertionError(f"expected an error containing one of {needles}")


# ------------------------------------------------------------------------------------------------ 2 ranks
def two_ranks(rank, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from accel_fp8_fix.distributed import collectives
    from accel_fp8_fix.testing.spy import CollectiveSpy

    out = {}
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    local = torch.full((3, 4), float(rank + 1))
    dt = DTensor.from_local(local.clone(), mesh, [Replicate()], run_check=False)  # rank-1 data: "stale" replica

    # the seed error, for real: a DTensor handed to c10d
    with CollectiveSpy() as spy:
        out["seed_error"] = _raises(lambda: dist.broadcast(dt, src=0), *SEED_ERRORS)
    bad = spy.calls("broadcast")
    assert len(bad) == 1 and bad[0].dtensor and bad[0].error, spy.summary()
    assert spy.dtensor_calls, "the spy must flag the DTensor that reached c10d"
    assert any(r.layer == "dispatch" and r.dtensor for r in spy.records), spy.summary()
    _raises(spy.assert_no_dtensor, "a DTensor reached c10d")

    # broadcast: local tensor, the DTensor's own mesh group, values on every rank
    with CollectiveSpy() as spy:
        collectives.broadcast(dt, src=0, name="w")
    assert torch.equal(dt.to_local(), torch.full((3, 4), 1.0)), dt.to_local()
    spy.assert_no_dtensor()
    (call,) = spy.calls("broadcast")
    assert call.group_ranks == (0, 1) and call.root == 0 and call.nbytes == 3 * 4 * 4 and call.dtype == torch.float32
    assert spy.nbytes("broadcast") == 48
    assert [r.op for r in spy.calls(layer="dispatch")] == ["c10d.broadcast_"], spy.summary()

    # non-contiguous plain tensor over an explicit group
    base = torch.arange(12.0).reshape(3, 4) * (rank + 1)
    view = base.t()
    collectives.broadcast(view, src=1, group=dist.group.WORLD, name="view")
    assert torch.equal(base, torch.arange(12.0).reshape(3, 4) * 2)

    # all_reduce on a replicated DTensor; MAX like an amax reduction
    amax = DTensor.from_local(torch.tensor([float(rank), 10.0 - rank]), mesh, [Replicate()], run_check=False)
    with CollectiveSpy() as spy:
        collectives.all_reduce(amax, op=dist.ReduceOp.MAX, name="amax")
    assert amax.to_local().tolist() == [1.0, 10.0]
    assert spy.groups("all_reduce") == [(0, 1)]
    spy.assert_no_dtensor()

    # refusals name the tensor
    sharded = DTensor.from_local(torch.ones(2, 4), mesh, [Shard(0)], run_check=False)
    out["shard"] = _raises(lambda: collectives.broadcast(sharded, dims="dp", name="layers.0.weight"), "'layers.0.weight'",
                           "not a replica")
    _raises(lambda: collectives.all_reduce(sharded, dims="dp", name="layers.0.weight"), "'layers.0.weight'", "not a replica")
    _raises(lambda: collectives.broadcast(sharded, group=dist.group.WORLD, name="layers.0.weight"), "'layers.0.weight'",
            "not a replica")
    _raises(lambda: collectives.all_reduce(sharded, group=dist.group.WORLD, name="layers.0.weight"), "'layers.0.weight'",
            "not a replica")
    with CollectiveSpy() as spy:  # replicated on no dim (dims=None): left as it is, no collective at all
        assert collectives.broadcast(sharded, name="s") is sharded and collectives.all_reduce(sharded, name="s") is sharded
    assert not spy.records and torch.equal(sharded.to_local(), torch.ones(2, 4)), spy.summary()
    out["plain"] = _raises(lambda: collectives.broadcast(torch.ones(2), name="buf"), "'buf'")
    assert "group=" in out["plain"] and "not promoted to a DTensor" in out["plain"], out["plain"]
    _raises(lambda: collectives.all_reduce(torch.ones(2), group=dist.group.WORLD, dims="dp", name="buf"), "'buf'", "not both")
    out["meta"] = _raises(lambda: collectives.broadcast(torch.ones(2, device="meta"), group=dist.group.WORLD, name="m"),
                          "'m'", "meta")
    out["src"] = _raises(lambda: collectives.broadcast(torch.ones(2), src=5, group=dist.group.WORLD, name="b"),
                         "'b'", "src=5")
    _raises(lambda: collectives.broadcast(torch.ones(2), group_src=2, group=dist.group.WORLD, name="b"), "'b'", "group_src=2")

    # variable size: rank 0 sends 37 bytes, rank 1 holds an empty uint8 (TE _extra_state); then an empty one
    payload = torch.frombuffer(bytearray(pickle.dumps({"scale": [1.5] * 3})), dtype=torch.uint8)
    mine = payload if rank == 0 else torch.empty(0, dtype=torch.uint8)
    with CollectiveSpy() as spy:
        got = collectives.broadcast_variable(mine, src=0, group=dist.group.WORLD, name="fc._extra_state")
    assert torch.equal(got, payload) and got.dtype == torch.uint8
    assert pickle.loads(got.numpy().tobytes()) == {"scale": [1.5] * 3}
    sizes = [c.nbytes for c in spy.calls("broadcast")]
    assert sizes == [16 * 8, payload.numel()], sizes  # header, then payload
    empty = collectives.broadcast_variable(torch.empty(0, dtype=torch.uint8) if rank == 0 else None, src=0,
                                 group=dist.group.WORLD, name="e")
    assert empty.numel() == 0 and empty.dtype == torch.uint8
    two_d = collectives.broadcast_variable(torch.arange(6, dtype=torch.bfloat16).reshape(2, 3) if rank == 1 else None,
                                 src=1, group=dist.group.WORLD)
    assert two_d.shape == (2, 3) and two_d.dtype == torch.bfloat16

    # objects: BytesIO travels as bytes; the spy sees the object call and the broadcasts inside it
    with CollectiveSpy() as spy:
        obj = collectives.broadcast_object(io.BytesIO(b"te1.x") if rank == 0 else None, src=0, group=dist.group.WORLD)
    assert isinstance(obj, io.BytesIO) and obj.getvalue() == b"te1.x"
    top = spy.calls(top_level=True)
    assert [c.op for c in top] == ["broadcast_object_list"], spy.summary()
    assert spy.calls("broadcast", top_level=False), "nested broadcasts inside broadcast_object_list"
    _raises(lambda: collectives.broadcast_object(dt, group=dist.group.WORLD, name="d"), "'d'")
    _raises(lambda: collectives.broadcast_variable(dt, group=dist.group.WORLD, name="d"), "'d'")
    gathered = collectives.all_gather_object(rank * 10, group=dist.group.WORLD)
    assert gathered == [0, 10]
    with CollectiveSpy() as spy:  # the mesh instead of a group: its dp group
        assert collectives.all_gather_object(rank * 10, mesh, "dp") == [0, 10]
        assert collectives.broadcast_object("x" if rank == 1 else None, mesh, group_src=1) == "x"
    assert {c.group_ranks for c in spy.calls(top_level=True)} == {(0, 1)}, spy.summary()
    _raises(lambda: collectives.all_gather_object(rank, name="o"), "'o'", "group=")
    _raises(lambda: collectives.broadcast_variable(None, name="v"), "'v'", "group=")

    # the spy restores everything it wrapped
    assert not hasattr(dist.broadcast, "__wrapped_by_collective_spy__")
    assert not hasattr(dist.distributed_c10d.broadcast, "__wrapped_by_collective_spy__")
    return out


def test_two_ranks_seed_error_helper_refusals_variable_size_spy():
    out = launcher.run(two_ranks, 2, timeout=120)
    assert any(n in out[0]["seed_error"] for n in SEED_ERRORS)
    for key in ("shard", "plain", "meta", "src"):
        assert out[0][key] == out[1][key] or key == "src"


# ------------------------------------------------------------------------------------------------ 4 ranks
def four_ranks(rank, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from accel_fp8_fix.distributed import collectives
    from accel_fp8_fix.testing.spy import CollectiveSpy

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))  # [[0, 1], [2, 3]]
    dp, tp = collectives.group_of(mesh, "dp"), collectives.group_of(mesh, "tp")
    assert collectives.group_ranks(dp) == ((0, 2) if rank % 2 == 0 else (1, 3))
    assert collectives.group_ranks(tp) == ((0, 1) if rank < 2 else (2, 3))
    assert collectives.group_of(mesh) is dist.group.WORLD and collectives.group_of(mesh, ("tp", "dp")) is dist.group.WORLD
    assert collectives.group_ranks(collectives.group_of(mesh["tp"])) == collectives.group_ranks(tp)
    if rank in (2, 3):
        assert collectives.to_group_rank(tp, 2) == 0 and collectives.to_group_rank(tp, 3) == 1
        assert collectives.to_global_rank(tp, 1) == 3
        _raises(lambda: collectives.to_group_rank(tp, 0, name="x"), "global rank 0 is not in", "'x'")
    if rank in (1, 3):
        assert collectives.to_group_rank(dp, 3) == 1 and collectives.to_global_rank(dp, 0) == 1

    # src is a GLOBAL rank: broadcast from global rank 2 over the tp group {2, 3} (group rank 0), and from
    # global rank 3 over the dp group {1, 3} (group rank 1: passing 3 as a group rank would be out of range)
    t = torch.full((4,), float(rank))
    with CollectiveSpy() as spy:
        if rank in (2, 3):
            collectives.broadcast(t, src=2, group=tp, name="t")
            assert t.tolist() == [2.0] * 4
        if rank in (1, 3):
            u = torch.full((2,), float(rank))
            collectives.broadcast(u, src=3, group=dp, name="u")
            assert u.tolist() == [3.0, 3.0]
    for call in spy.calls("broadcast"):
        assert call.group_ranks in ((2, 3), (1, 3)) and call.root in (2, 3), spy.summary()
    if rank == 0:
        _raises(lambda: collectives.broadcast(torch.ones(1), src=1, group=dp, name="v"), "src=1 (a global rank) is not in the group [0, 2]")
        assert "'v'" in _raises(lambda: collectives.broadcast(torch.ones(1), src=1, group=dp, name="v"), "src=1")

    # 2-D DTensor: Shard on dp, Replicate on tp. Broadcast over tp is fine, over dp / the whole mesh refused.
    local = torch.full((2, 3), float(rank))
    dt = DTensor.from_local(local, mesh, [Shard(0), Replicate()], run_check=False)
    with CollectiveSpy() as spy:
        collectives.broadcast(dt, dims="tp", src=0 if rank < 2 else 2, name="w2d")
    assert torch.equal(dt.to_local(), torch.full((2, 3), 0.0 if rank < 2 else 2.0))
    spy.assert_no_dtensor()
    assert spy.groups("broadcast") == [(0, 1) if rank < 2 else (2, 3)]
    msg = _raises(lambda: collectives.broadcast(dt, dims="dp", name="w2d"), "'w2d'", "Shard(dim=0)", "dp")
    _raises(lambda: collectives.broadcast(dt, dims=("dp", "tp"), name="w2d"), "not a replica")
    _raises(lambda: collectives.broadcast(dt, group=dist.group.WORLD, name="w2d"), "not a replica")
    _raises(lambda: collectives.broadcast(dt, dims="nope", name="w2d"), "no dim named 'nope'")

    # a flattened group that is not WORLD: dims (b, c) of a (2, 1, 2) mesh -> new groups {0, 1} / {2, 3}
    mesh3 = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("a", "b", "c"))
    flat = collectives.group_of(mesh3, ("b", "c"))
    assert collectives.group_ranks(flat) == ((0, 1) if rank < 2 else (2, 3))
    assert collectives.group_of(mesh3, ("c", "b")) is flat  # cached
    s = torch.tensor([float(rank)])
    collectives.all_reduce(s, mesh3, ("b", "c"), name="s")
    assert s.item() == (1.0 if rank < 2 else 5.0)
    return msg


def test_four_ranks_2x2_mesh_groups_and_src_translation():
    msgs = launcher.run(four_ranks, 4, timeout=60)
    assert all("'w2d'" in m for m in msgs)


# ------------------------------------------------------------------------------------------------ in-process
def test_subgroup_layout_and_dims():
    from types import SimpleNamespace

    from accel_fp8_fix.distributed.collectives import CollectiveError, _subgroup_layout, mesh_dims

    fake = SimpleNamespace(mesh=torch.arange(8).reshape(2, 2, 2), ndim=3, mesh_dim_names=("pp", "dp", "tp"))
    assert _subgroup_layout(fake, (1, 2)) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert _subgroup_layout(fake, (0, 2)) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert _subgroup_layout(fake, (0,)) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert mesh_dims(fake, ("tp", "pp")) == (0, 2) and mesh_dims(fake, -1) == (2,)
    with pytest.raises(CollectiveError, match="twice"):
        mesh_dims(fake, ("tp", 2))


def test_helpers_refuse_without_process_group():
    """A group kept past ``destroy_process_group``: every collective refuses, naming the tensor."""
    import torch.distributed as dist

    from accel_fp8_fix.distributed import collectives

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    stale = dist.group.WORLD
    dist.destroy_process_group()
    calls = {"broadcast": lambda: collectives.broadcast(torch.ones(1), group=stale, name="x"),
             "all_reduce": lambda: collectives.all_reduce(torch.ones(1), group=stale, name="x"),
             "all_gather": lambda: collectives.all_gather(torch.ones(1), group=stale, name="x"),
             "broadcast_variable": lambda: collectives.broadcast_variable(torch.ones(1), group=stale, name="x"),
             "broadcast_object": lambda: collectives.broadcast_object(1, group=stale, name="x"),
             "all_gather_object": lambda: collectives.all_gather_object(1, group=stale, name="x")}
    for op, call in calls.items():
        with pytest.raises(collectives.CollectiveError, match=f"{op} of 'x'.*no default process group"):
            call()
