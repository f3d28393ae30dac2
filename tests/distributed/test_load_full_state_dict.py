"""accelerate's ``fsdp2_load_full_state_dict`` (cpu_ram_efficient_loading), stock vs fixed, on gloo ranks.

The real function (``accelerate.utils.fsdp_utils.fsdp2_load_full_state_dict``) is called on a model that
was ``fully_shard``-ed (and TP-parallelised) as a meta copy, exactly as ``fsdp2_prepare_model`` does; the
accelerator is a stand-in exposing ``is_main_process`` and ``device``. Stock runs with the patch set
deactivated in the same processes, then the fix runs on the same meta model.

Launches: FSDP2 with buffers and three kinds of ``_extra_state`` (A5; 2 ranks), TP Shard(0)/Shard(1) at
load on a 1-D tp mesh (A6; 2 ranks), and 2-D dp_shard x tp (4 ranks).
"""

from __future__ import annotations

import copy
import io
import pickle
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import accel_fp8_fix
from accel_fp8_fix.testing import DistributedTestError
from support import launcher
from support import versions


# ------------------------------------------------------------------------------------------------ models
class TE2Like(nn.Module):
    """TE 2.x-style extra state: a uint8 tensor of a pickle, empty when there is no FP8 state."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.blob = b""

    def get_extra_state(self):
        if not self.blob:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(bytearray(self.blob), dtype=torch.uint8)

    def set_extra_state(self, state):
        assert isinstance(state, torch.Tensor) and state.dtype == torch.uint8, type(state)
        self.blob = state.numpy().tobytes()


class TE1Like(nn.Module):
    """TE 1.x-style extra state: an io.BytesIO."""

    def __init__(self):
        super().__init__()
        self.blob = b""

    def get_extra_state(self):
        return io.BytesIO(self.blob)

    def set_extra_state(self, state):
        assert isinstance(state, io.BytesIO), type(state)
        self.blob = state.getvalue()


class ObjState(nn.Module):
    def __init__(self):
        super().__init__()
        self.state = {}

    def get_extra_state(self):
        return dict(self.state)

    def set_extra_state(self, state):
        self.state = dict(state)


class Net(nn.Module):
    def __init__(self, extras: bool = True, buffers: bool = True):
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)
        self.norm = nn.LayerNorm(8)
        if buffers:
            self.register_buffer("scale", torch.linspace(0.5, 2.0, 8))
            self.register_buffer("steps", torch.tensor([7], dtype=torch.int64))
        if extras:
            self.te = TE2Like()
            self.te1 = TE1Like()
            self.obj = ObjState()

    def forward(self, x):
        y = self.norm(self.down(torch.relu(self.up(x))))
        if hasattr(self, "scale"):
            y = y * self.scale
        if hasattr(self, "te"):
            y = self.te.proj(y)
        return y


def _reference(extras=True, buffers=True):
    torch.manual_seed(0)
    ref = Net(extras, buffers)
    if extras:  # FP8 state exists on rank 0's real model only; its size is known to rank 0 alone
        ref.te.blob = pickle.dumps({"amax_history": torch.rand(5).tolist(), "recipe": "delayed"})
        ref.te1.blob = b"torch.save payload of TE 1.x"
        ref.obj.state = {"step": 11, "recipe": "hybrid"}
    return ref


def _meta_copy(ref):
    meta = copy.deepcopy(ref).to("meta")  # as fsdp2_prepare_model does with cpu_ram_efficient_loading
    if hasattr(meta, "te"):
        meta.te.blob, meta.te1.blob, meta.obj.state = b"", b"", {}  # fresh modules: no FP8 state
    return meta


def _full_sd_for(rank, source_sd):
    if rank == 0:
        return source_sd
    # other ranks may hold anything: meta tensors here
    return {k: (torch.empty_like(v, device="meta") if isinstance(v, torch.Tensor) else None) for k, v in source_sd.items()}


def _accelerator(rank):
    return SimpleNamespace(is_main_process=rank == 0, device=torch.device("cpu"))


def _stock_error(accelerator, model, full_sd):
    import accelerate.utils.fsdp_utils as fu

    accel_fp8_fix.deactivate()
    try:
        assert not hasattr(fu.fsdp2_load_full_state_dict, "_self_fix_spec"), "the patch is still applied"
        fu.fsdp2_load_full_state_dict(accelerator, model, full_sd)
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    finally:
        accel_fp8_fix.activate()
    return None


def _patched_load(accelerator, model, full_sd, cpu_offload=False):
    import accelerate.utils.fsdp_utils as fu

    from accel_fp8_fix.testing.spy import CollectiveSpy

    assert getattr(fu.fsdp2_load_full_state_dict, "_self_fix_spec", None) is not None, "the patch is not applied"
    with CollectiveSpy() as spy:
        out = fu.fsdp2_load_full_state_dict(accelerator, model, full_sd, cpu_offload=cpu_offload)
    assert out is model
    return spy


def _assert_loaded(model, ref, spy, world):
    """Every entry bit for bit rank 0's value; only WORLD broadcasts; no DTensor reached c10d."""
    from torch.distributed.tensor import DTensor

    ref_sd = ref.state_dict()
    loaded = model.state_dict()
    assert list(loaded) == list(ref_sd)
    for name, value in loaded.items():
        want = ref_sd[name]
        if name.endswith("_extra_state"):
            if isinstance(want, torch.Tensor):
                assert torch.equal(value, want), name
            elif isinstance(want, io.BytesIO):
                assert value.getvalue() == want.getvalue(), name
            else:
                assert value == want, name
            continue
        if isinstance(value, DTensor):
            got = value.full_tensor()
        else:
            assert value.device.type != "meta", name
            got = value
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(got, want), name
    for name, p in model.named_parameters():
        assert isinstance(p, nn.Parameter) and p.device.type == "cpu", name
    if hasattr(model, "te"):
        assert model.te.blob == ref.te.blob and model.te1.blob == ref.te1.blob and model.obj.state == ref.obj.state
    spy.assert_no_dtensor()
    top = spy.calls(top_level=True)
    assert {c.op for c in top} <= {"broadcast", "broadcast_object_list", "all_gather_object"}, spy.summary()
    assert spy.groups(layer="python") == [tuple(range(world))], spy.summary()
    # no second round of communication (stock's distribute_tensor(src_data_rank=0) scatters / broadcasts)
    assert not spy.calls("scatter") and all(c.group_ranks == tuple(range(world)) for c in spy.calls("broadcast"))
    param_bytes = sum(v.numel() * v.element_size() for k, v in ref_sd.items() if isinstance(v, torch.Tensor))
    assert spy.nbytes("broadcast") >= param_bytes
    return spy.nbytes("broadcast")


# ------------------------------------------------------------------------------------------------ A5: FSDP2
def fsdp_buffers_extra_state(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from accel_fp8_fix.fixes.checkpoint.load_full_state_dict import LoadFullStateDictError

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    ref = _reference()
    meta = _meta_copy(ref)
    fully_shard(meta.up, mesh=mesh)
    fully_shard(meta, mesh=mesh)
    acc = _accelerator(rank)
    full_sd = _full_sd_for(rank, ref.state_dict())

    if versions.accelerate_at_least("1.16"):
        # 1.16 loads plain buffers, but rank 0 meets a non-tensor extra state before its broadcast while the
        # others wait in theirs (a hang): stock is asked about the buffers alone
        plain = _reference(extras=False)
        plain_meta = _meta_copy(plain)
        fully_shard(plain_meta, mesh=mesh)
        stock = _stock_error(acc, plain_meta, _full_sd_for(rank, plain.state_dict()))
        if stock is None:
            torch.testing.assert_close(plain_meta.scale, plain.scale, rtol=0, atol=0)
    else:
        stock = _stock_error(acc, meta, full_sd)

    # a key missing from rank 0's full state dict: every rank raises, naming it (no rank left hanging)
    broken = {k: v for k, v in full_sd.items() if k != "down.weight"} if rank == 0 else full_sd
    try:
        _patched_load(acc, meta, broken)
        missing = None
    except LoadFullStateDictError as exc:
        missing = str(exc)

    spy = _patched_load(acc, meta, full_sd)
    nbytes = _assert_loaded(meta, ref, spy, world)
    torch.manual_seed(1)
    x = torch.randn(4, 8)
    torch.testing.assert_close(meta(x), ref(x), rtol=0, atol=1e-6)  # the loaded FSDP2 model computes as rank 0
    return {"stock": stock, "missing": missing, "bytes": nbytes}


def test_a5_fsdp2_buffers_and_extra_state():
    out = launcher.run(fsdp_buffers_extra_state, 2, timeout=90)
    for r in out:
        if versions.accelerate_at_least("1.16"):
            assert r["stock"] is None  # 1.16 fixed the plain-buffer half of A5 (the extra-state half stays)
        else:
            assert "'Tensor' object has no attribute 'device_mesh'" in r["stock"], r["stock"]
        assert r["missing"] and "'down.weight'" in r["missing"] and "missing from rank 0" in r["missing"]
    assert out[0]["bytes"] > 0


# ------------------------------------------------------------------------------------------------ A6: TP at load
def _tp_source(ref, tp_mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    src = copy.deepcopy(ref)  # what transformers' tp_plan loading leaves on every rank: TP DTensors
    parallelize_module(src, tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return src


def tp_sharded_at_load(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp_shard", "tp"))
    tp = mesh["tp"]
    out = {}

    # stock, on TP params alone (no buffers, so the first entry is a TP-sharded weight)
    ref = _reference(extras=False, buffers=False)
    src = _tp_source(ref, tp)
    sd = src.state_dict()
    assert isinstance(sd["up.weight"], DTensor) and sd["up.weight"].placements == (Shard(0),)
    assert sd["down.weight"].placements == (Shard(1),)
    meta = _meta_copy(ref)
    parallelize_module(meta, tp, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(meta, mesh=mesh["dp_shard"])
    out["stock"] = _stock_error(_accelerator(rank), meta, sd)
    if out["stock"] is None:  # this rank "succeeded": are its shards rank 0's values? (local check, no comm)
        from torch.distributed.tensor import distribute_tensor

        ref_sd = ref.state_dict()
        out["stock_corrupt"] = [
            k for k, v in meta.state_dict().items()
            if tuple(v.shape) != tuple(ref_sd[k].shape)
            or not torch.equal(v.to_local(), distribute_tensor(ref_sd[k], v.device_mesh, v.placements,
                                                               src_data_rank=None).to_local())
        ]

    # the fix, with buffers and extra state too; rank 0's source entries are TP DTensors
    ref = _reference()
    src = _tp_source(ref, tp)
    meta = _meta_copy(ref)
    parallelize_module(meta, tp, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(meta, mesh=mesh["dp_shard"])
    spy = _patched_load(_accelerator(rank), meta, src.state_dict())
    _assert_loaded(meta, ref, spy, world)
    # the source DTensors were gathered on their own tp mesh (functional all-gather), nothing else
    gathers = spy.calls(layer="dispatch", top_level=True)
    assert gathers and all(c.group_ranks == tuple(range(world)) for c in gathers), spy.summary()
    torch.manual_seed(1)
    x = torch.randn(4, 8)
    torch.testing.assert_close(meta(x), ref(x))  # TP matmul order may differ in the last bit
    return out


def test_a6_tp_sharded_params_at_load():
    with pytest.raises(DistributedTestError) as info:
        launcher.run(tp_sharded_at_load, 2, timeout=90, collective_timeout=20)
    # stock: rank 0 broadcast its local shard, the others the global shape — gloo lets it through, NCCL would
    # not: the collective-order audit names it (the first divergence of the group; the fixed path that runs
    # after it in this launch is audited on its own in the 2-D tests below)
    assert info.value.divergences == [
        "group [0, 1]: collective #4 differs between ranks 0 and 1: rank 0 issued broadcast (gloo:broadcast) float32 "
        "numel=64 on group [0, 1]; rank 1 issued broadcast (gloo:broadcast) float32 numel=128 on group [0, 1]"]
    out = info.value.results
    # rank 0 fails in load_state_dict, the others load whatever arrived (silently wrong values), or fail
    assert out[0]["stock"] and "size mismatch" in out[0]["stock"], out[0]["stock"]
    for r in out[1:]:
        assert r["stock"] is not None or r["stock_corrupt"], r


# ------------------------------------------------------------------------------------------------ 2-D
def dp_tp_2d(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    ref = _reference()
    src = _tp_source(ref, mesh["tp"])
    full_sd = src.state_dict()  # TP DTensors on every rank, as transformers' tp_plan loading leaves them
    meta = _meta_copy(ref)
    parallelize_module(meta, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(meta.up, mesh=mesh["dp_shard"])
    fully_shard(meta, mesh=mesh["dp_shard"])
    sd = meta.state_dict()
    assert sd["up.weight"].device_mesh.ndim == 2  # dp_shard x tp
    assert sd["norm.weight"].device_mesh.ndim == 1  # not TP'd: on dp_shard only ({0, 2} or {1, 3})
    spy = _patched_load(_accelerator(rank), meta, full_sd)
    _assert_loaded(meta, ref, spy, world)
    placements = {k: tuple(map(repr, v.placements)) for k, v in meta.state_dict().items() if isinstance(v, DTensor)}
    torch.manual_seed(1)
    x = torch.randn(4, 8)
    torch.testing.assert_close(meta(x), ref(x))
    return placements


def test_2d_dp_shard_x_tp_four_ranks():
    out = launcher.run(dp_tp_2d, 4, timeout=120)
    placements = out[0]
    assert placements["down.weight"] == ("Shard(dim=0)", "Shard(dim=1)"), placements  # FSDP dim 0, TP rowwise
    assert "StridedShard" in placements["up.weight"][0] and placements["up.weight"][1] == "Shard(dim=0)", placements
    assert placements["norm.weight"] == ("Shard(dim=0)",), placements  # 1-D on dp_shard: {0, 2} / {1, 3}
