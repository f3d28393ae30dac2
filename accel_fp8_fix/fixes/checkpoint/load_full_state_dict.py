"""``fsdp2_load_full_state_dict`` (cpu_ram_efficient_loading), done right (failures A5, A6: docs/failures.md).

accelerate 1.13-1.16 reads ``.device_mesh`` on every ``model.state_dict()`` entry (plain buffers and TE
``_extra_state`` raise ``'Tensor' object has no attribute 'device_mesh'``, A5), broadcasts rank 0's *local*
TP shard while the other ranks allocate the global shape (size mismatch, A6), allocates the receive buffer
with the model's dtype instead of the sender's, and then calls ``distribute_tensor`` with its default
``src_data_rank=0`` (a second round of communication for data every rank already has).

This replacement (it does not call the original), with rank 0 as the only rank holding real data:

0. Rank 0 broadcasts a *manifest* of its full state dict (kind, global shape, dtype, device, and for a
   DTensor its mesh ranks and placements) as one object; every rank checks every entry of its own
   (meta, sharded) ``model.state_dict()`` against it and the ranks agree on the verdict with one
   ``all_gather_object`` before any tensor moves, so a bad entry raises on every rank, naming the
   parameter, instead of leaving the others stuck in a broadcast.
1. DTensor entry (a sharded parameter): if rank 0's value is itself a DTensor (TP-sharded at load), every
   rank of *that* DTensor's mesh calls ``full_tensor()`` on its own copy (an all-gather needs all of them,
   not only rank 0); rank 0 then broadcasts the GLOBAL tensor and every rank takes its own shard locally
   with ``distribute_tensor(..., src_data_rank=None)`` (no second communication); dtype / contiguity cast
   as stock; ``.to("cpu")`` when ``cpu_offload``.
2. Plain tensor entry (a buffer): broadcast and loaded as a plain tensor on the compute device (FSDP2's
   CPU offload covers sharded parameters, not buffers).
3. ``*._extra_state``: a tensor (TE 2.x: uint8 pickle, possibly empty) travels with its own shape and
   dtype (variable size: receivers allocate what rank 0 announced, not what their meta module holds),
   an ``io.BytesIO`` (TE 1.x) as its bytes, anything else as a pickled object; ``load_state_dict`` then
   hands it to ``set_extra_state``.
4. Any other non-tensor entry: ``broadcast_object``.

Every transfer goes through :mod:`accel_fp8_fix.distributed.collectives` with ``group=WORLD`` named
explicitly. WORLD, not the parameter's mesh, because the function's contract is that every process calls
it and only global rank 0 holds the data: every rank must receive every entry, and rank 0 is not in every
rank's mesh group (e.g. a plain parameter under 2-D FSDP x TP lives on ``mesh["dp_shard"]``, whose group
for rank 1 is {1, 3}). The only other group used is the one ``full_tensor()`` uses: the source DTensor's
own mesh. Then ``model.load_state_dict(sharded_sd, assign=True)`` as stock, and the model is returned.
"""

from __future__ import annotations

import inspect
import io
from dataclasses import dataclass

import torch

from ...distributed import collectives as C
from ...distributed.dtensor import is_dtensor

EXTRA_STATE_SUFFIX = "_extra_state"  # torch.nn.modules.module._EXTRA_STATE_KEY_SUFFIX
SRC = 0  # accelerate's main process (is_main_process) is global rank 0


class LoadFullStateDictError(RuntimeError):
    """The full state dict cannot be loaded into the sharded model (names the parameter)."""


@dataclass(frozen=True)
class _Entry:
    """What global rank 0 holds for one key (pickled into the manifest)."""

    kind: str  # "tensor" | "dtensor" | "bytesio" | "object" | "missing" | "meta"
    shape: tuple = ()
    dtype: torch.dtype | None = None
    device_type: str = "cpu"
    mesh_ranks: tuple = ()  # kind == "dtensor": global ranks of the source DTensor's mesh (flattened)
    mesh_layout: tuple = ()  # its mesh as nested tuples (identity check on the other ranks)
    placements: str = ""
    type_name: str = ""


def _describe(value) -> _Entry:
    if is_dtensor(value):
        mesh = value.device_mesh
        return _Entry(
            "dtensor", tuple(value.shape), value.dtype, mesh.device_type,
            tuple(int(r) for r in mesh.mesh.flatten().tolist()), _nested(mesh.mesh.tolist()),
            repr(tuple(value.placements)),
        )
    if isinstance(value, torch.Tensor):
        if value.device.type == "meta":
            return _Entry("meta", tuple(value.shape), value.dtype, "meta")
        return _Entry("tensor", tuple(value.shape), value.dtype, value.device.type)
    if isinstance(value, io.BytesIO):
        return _Entry("bytesio", type_name="io.BytesIO")
    return _Entry("object", type_name=type(value).__name__)


def _nested(x):
    return tuple(_nested(v) for v in x) if isinstance(x, list) else x


def _bind(wrapped, args, kwargs):
    try:
        bound = inspect.signature(wrapped).bind(*args, **kwargs)
    except (TypeError, ValueError):
        params = ["accelerator", "model", "full_sd", "cpu_offload"]
        bound_args = dict(zip(params, args))
        bound_args.update(kwargs)
        return bound_args["accelerator"], bound_args["model"], bound_args["full_sd"], bound_args.get("cpu_offload", False)
    bound.apply_defaults()
    a = bound.arguments
    return a["accelerator"], a["model"], a["full_sd"], a.get("cpu_offload", False)


def load_full_state_dict(wrapped, instance, args, kwargs):
    """wrapt wrapper for ``accelerate.utils.fsdp_utils.fsdp2_load_full_state_dict`` (replaces it)."""
    accelerator, model, full_sd, cpu_offload = _bind(wrapped, args, kwargs)
    return fsdp2_load_full_state_dict(accelerator, model, full_sd, cpu_offload=cpu_offload)


# ------------------------------------------------------------------------------------------------ helpers
def _target_dtype_and_contiguity(model, name, target, source_dtype):
    """Stock ``_infer_parameter_dtype``: cast floating values to the model's dtype (not float8_e4m3fn)."""
    try:
        old = model.get_parameter_or_buffer(name)
    except AttributeError:
        base, _, local = name.rpartition(".")
        old = getattr(model.get_submodule(base) if base else model, local, None)
    if old is None:
        old = target
    e4m3 = getattr(torch, "float8_e4m3fn", None)
    cast = None
    if source_dtype is not None and source_dtype.is_floating_point and source_dtype != e4m3:
        cast = old.dtype
    return old.is_contiguous(), cast


def _cast(t, contiguous, dtype):
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype=dtype)
    if contiguous:
        t = t.contiguous()
    return t


def _compute_device(accelerator, model_sd) -> torch.device:
    """Where buffers and receive buffers live: the model's mesh device (accelerator.device's index)."""
    device_type = None
    for v in model_sd.values():
        if is_dtensor(v):
            device_type = v.device_mesh.device_type
            break
    acc_device = getattr(accelerator, "device", None)
    if acc_device is not None:
        acc_device = torch.device(acc_device)
        if device_type is None or acc_device.type == device_type:
            return acc_device
    if device_type is None:
        import torch.distributed as dist

        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    if device_type == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


def _check_entry(name, target, entry: _Entry, full_sd, me) -> str | None:
    """This rank's verdict on one key (None: fine)."""
    if entry.kind == "missing":
        return (
            f"Parameter '{name}' found in sharded model state dict but missing from rank {SRC}'s full state dict"
        )
    if entry.kind == "meta":
        return f"'{name}': rank {SRC}'s full state dict holds it on the meta device (no data to load)"
    if isinstance(target, torch.Tensor) and not name.endswith(EXTRA_STATE_SUFFIX):
        if entry.kind not in ("tensor", "dtensor"):
            return f"'{name}': the model holds a tensor but rank {SRC} has a {entry.type_name}"
        if tuple(target.shape) != entry.shape:
            return (
                f"'{name}': rank {SRC}'s value has global shape {list(entry.shape)}, the model expects "
                f"{list(target.shape)}"
            )
    if entry.kind == "dtensor" and me in entry.mesh_ranks:
        mine = full_sd.get(name) if isinstance(full_sd, dict) else None
        if not is_dtensor(mine):
            return (
                f"'{name}': rank {SRC}'s value is a DTensor on mesh ranks {list(entry.mesh_ranks)}; rank {me} is on "
                f"that mesh and must take part in gathering it, but its full state dict holds "
                f"{type(mine).__name__} there"
            )
        mine_entry = _describe(mine)
        if (mine_entry.mesh_layout, mine_entry.placements, mine_entry.shape) != (
            entry.mesh_layout, entry.placements, entry.shape,
        ):
            return (
                f"'{name}': rank {SRC}'s DTensor ({entry.placements} on {entry.mesh_layout}, {list(entry.shape)}) and "
                f"rank {me}'s ({mine_entry.placements} on {mine_entry.mesh_layout}, {list(mine_entry.shape)}) differ"
            )
    return None


# ------------------------------------------------------------------------------------------------ the fix
def fsdp2_load_full_state_dict(accelerator, model: torch.nn.Module, full_sd: dict, cpu_offload: bool = False):
    """Load rank 0's full state dict into the (meta, sharded) ``model`` on every rank; returns ``model``."""
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor

    if not (dist.is_available() and dist.is_initialized()):
        raise LoadFullStateDictError(
            "accel_fp8_fix: fsdp2_load_full_state_dict needs an initialised process group (it is collective)"
        )
    world = dist.group.WORLD
    me = dist.get_rank()
    is_main = bool(getattr(accelerator, "is_main_process", me == SRC))
    if is_main != (me == SRC):
        raise LoadFullStateDictError(
            f"accel_fp8_fix: rank {me} has is_main_process={is_main}; the full state dict must be on global rank {SRC}"
        )
    model_sd = model.state_dict()
    keys = list(model_sd)

    # 0. manifest from rank 0, then a collective verdict before any tensor moves
    manifest = None
    if me == SRC:
        manifest = {k: (_describe(full_sd[k]) if k in full_sd else _Entry("missing")) for k in keys}
    manifest = C.broadcast_object(manifest, src=SRC, group=world, name="full state dict manifest")
    problems = []
    if list(manifest) != keys:
        extra = sorted(set(keys) - set(manifest))
        absent = sorted(set(manifest) - set(keys))
        if extra or absent:
            problems.append(
                f"rank {me}'s model state dict differs from rank {SRC}'s: only here {extra[:5]}, "
                f"only on rank {SRC} {absent[:5]}"
            )
    if not problems:
        for name in keys:
            problem = _check_entry(name, model_sd[name], manifest[name], full_sd, me)
            if problem:
                problems.append(problem)
    verdicts = C.all_gather_object(problems, group=world, name="load_full_state_dict verdicts")
    failed = [(r, p) for r, ps in enumerate(verdicts) for p in ps]
    if failed:
        detail = "\n  ".join(f"rank {r}: {p}" for r, p in failed[:20])
        more = f"\n  ... and {len(failed) - 20} more" if len(failed) > 20 else ""
        raise LoadFullStateDictError(
            f"accel_fp8_fix: cannot load the full state dict into the sharded model:\n  {detail}{more}"
        )

    keys = list(manifest)  # rank 0's order on every rank (same key set, checked above)
    device = _compute_device(accelerator, model_sd)
    sharded_sd = {}
    for name in keys:
        target = model_sd[name]
        entry: _Entry = manifest[name]
        try:
            sharded_sd[name] = _load_one(
                name, target, entry, full_sd, model, me, device, cpu_offload, distribute_tensor, world
            )
        except C.CollectiveError:
            raise
        except Exception as exc:
            raise LoadFullStateDictError(f"accel_fp8_fix: loading '{name}' failed on rank {me}: {exc}") from exc

    # we set `assign=True` because our params are on meta device (as stock)
    model.load_state_dict(sharded_sd, assign=True)
    return model


def _global_source(name, entry: _Entry, full_sd, me, device):
    """On rank 0 (and on the ranks of rank 0's source DTensor mesh): the global tensor, else None."""
    value = full_sd.get(name) if isinstance(full_sd, dict) else None
    if entry.kind == "dtensor":
        if me in entry.mesh_ranks:
            with torch.no_grad():
                full = value.full_tensor()  # collective over the source DTensor's mesh: all its ranks join
            return full.detach().to(device) if me == SRC else None
        return None
    if me == SRC:
        return value.detach().to(device)
    return None


def _load_one(name, target, entry, full_sd, model, me, device, cpu_offload, distribute_tensor, world):
    if name.endswith(EXTRA_STATE_SUFFIX) or entry.kind in ("bytesio", "object"):
        return _load_extra(name, entry, full_sd, me, device, world)

    # Tensors: the global value, broadcast from rank 0 over WORLD (see module docstring)
    full = _global_source(name, entry, full_sd, me, device)
    if me != SRC:
        full = torch.empty(entry.shape, dtype=entry.dtype, device=device)
    C.broadcast(full, src=SRC, group=world, name=name)
    contiguous, dtype = _target_dtype_and_contiguity(model, name, target, entry.dtype)
    if is_dtensor(target):
        mesh = target.device_mesh
        full = full.to(mesh.device_type) if full.device.type != mesh.device_type else full
        # Every rank has the global value: take the local shard with no further communication.
        sharded = distribute_tensor(full, mesh, target.placements, src_data_rank=None)
        sharded = _cast(sharded, contiguous, dtype)
        if cpu_offload:
            sharded = sharded.to("cpu")
        return sharded
    # A plain tensor (buffer): loaded as a plain tensor, on the compute device
    return _cast(full, contiguous, dtype)


def _load_extra(name, entry: _Entry, full_sd, me, device, world):
    value = full_sd.get(name) if me == SRC and isinstance(full_sd, dict) else None
    if entry.kind == "tensor":
        # Variable size: what rank 0 has (a pickled FP8 state, maybe empty), not what the meta module holds.
        src_tensor = value.detach() if me == SRC else None
        out = C.broadcast_variable(src_tensor, src=SRC, group=world, name=name, device=device)
        return out.to(entry.device_type) if out.device.type != entry.device_type else out
    if entry.kind == "dtensor":
        raise LoadFullStateDictError(f"accel_fp8_fix: '{name}': an extra state held as a DTensor is not supported")
    # io.BytesIO (TE 1.x torch.save payload) or any picklable object
    return C.broadcast_object(value, src=SRC, group=world, name=name)
