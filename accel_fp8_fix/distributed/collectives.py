"""One family of collectives that never hands a DTensor to c10d and always names its process group.

``torch.distributed.broadcast(dtensor, ...)`` goes through DTensor dispatch for ``c10d.broadcast_.default``
and fails (torch 2.13: "does not have a sharding strategy registered"; older torch: "found no DeviceMesh
from dtensor args"); ``dist.scatter`` with DTensors is not even checked. One private core, :func:`_resolve`,
turns (tensor, mesh, dims, group, name, op) into (the local tensor, the process group); the public names are
thin wrappers around it, each taking the mesh (and dims) or the group explicitly::

    broadcast(t, mesh=None, dims=None, *, src=None, group_src=None, group=None, name=None)
    all_reduce(t, mesh=None, dims=None, *, op=SUM, group=None, name=None)
    all_gather(t, mesh=None, dims=None, *, group=None, name=None)
    broadcast_variable(t, mesh=None, dims=None, *, src=None, group_src=None, group=None, name=None, device=None)
    broadcast_object(obj, mesh=None, dims=None, *, src=None, group_src=None, group=None, name=None, device=None)
    all_gather_object(obj, mesh=None, dims=None, *, group=None, name=None)
    barrier_async(group)                      # the Work, to wait for with a timeout

They refuse what would be wrong silently:

* a DTensor broadcast / all-reduced over a mesh dim it is sharded (or partial) on: a shard is not a replica;
* a plain tensor (or object) with no group at all (nothing defaults to WORLD: pass ``group=dist.group.WORLD``);
* ``src`` (always a GLOBAL rank; ``group_src`` is the group's rank) outside the group, or the calling rank
  outside the group.

Errors name the tensor (``name=``). :func:`group_of` turns a mesh (or some of its dims) into one
ProcessGroup: it must be called on every rank of the default group, in the same order (it may create
groups with ``dist.new_group``, a collective over the whole world).
"""

from __future__ import annotations

import io
import threading
import weakref
from typing import Any

import torch
import torch.distributed as dist

from .. import caches
from .dtensor import is_dtensor

__all__ = [
    "CollectiveError",
    "group_of",
    "group_ranks",
    "to_group_rank",
    "to_global_rank",
    "mesh_dims",
    "broadcast",
    "all_reduce",
    "all_gather",
    "broadcast_variable",
    "broadcast_object",
    "all_gather_object",
    "barrier_async",
    "clear_group_cache",
]


class CollectiveError(ValueError):
    """A collective was asked for something that would be wrong (it names the tensor and the group)."""


# ------------------------------------------------------------------------------------------------ basics
def _label(name: str | None, tensor: Any = None) -> str:
    if name:
        return repr(name)
    if isinstance(tensor, torch.Tensor):
        kind = "DTensor" if is_dtensor(tensor) else "tensor"
        return f"<unnamed {kind} {tuple(tensor.shape)} {tensor.dtype}>"
    return "<unnamed>"


def group_ranks(group=None) -> tuple[int, ...]:
    """The GLOBAL ranks of ``group`` (None: WORLD), in group-rank order."""
    return tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def to_group_rank(group, global_rank: int, *, name: str | None = None) -> int:
    """Translate a GLOBAL rank into ``group``'s rank; CollectiveError when it is not a member."""
    group = group if group is not None else dist.group.WORLD
    ranks = group_ranks(group)
    if global_rank not in ranks:
        raise CollectiveError(
            f"accel_fp8_fix: global rank {global_rank} is not in the process group of ranks {list(ranks)}"
            + (f" (tensor {_label(name)})" if name else "")
        )
    return dist.get_group_rank(group, global_rank)


def to_global_rank(group, group_rank: int) -> int:
    """Translate ``group``'s rank into the GLOBAL rank."""
    group = group if group is not None else dist.group.WORLD
    ranks = group_ranks(group)
    if not 0 <= group_rank < len(ranks):
        raise CollectiveError(f"accel_fp8_fix: group rank {group_rank} out of range for group {list(ranks)}")
    return dist.get_global_rank(group, group_rank)


# ------------------------------------------------------------------------------------------------ meshes
def mesh_dims(mesh, dims=None) -> tuple[int, ...]:
    """``dims`` (None = all; a name, an index, or a sequence of them) as sorted mesh-dim indices."""
    if dims is None:
        return tuple(range(mesh.ndim))
    if isinstance(dims, (str, int)):
        dims = (dims,)
    names = tuple(mesh.mesh_dim_names or ())
    out = []
    for d in dims:
        if isinstance(d, str):
            if d not in names:
                raise CollectiveError(f"accel_fp8_fix: mesh {mesh} has no dim named {d!r} (dims: {names})")
            out.append(names.index(d))
        elif isinstance(d, int) and -mesh.ndim <= d < mesh.ndim:
            out.append(d % mesh.ndim)
        else:
            raise CollectiveError(f"accel_fp8_fix: {d!r} is not a dim of mesh {mesh}")
    if len(set(out)) != len(out):
        raise CollectiveError(f"accel_fp8_fix: dims {dims!r} name a mesh dim twice")
    return tuple(sorted(out))


def _subgroup_layout(mesh, dim_idx: tuple[int, ...]) -> list[list[int]]:
    """Every group of ``mesh`` spanned by ``dim_idx`` (the other dims fixed), as lists of global ranks."""
    layout = mesh.mesh
    other = [d for d in range(mesh.ndim) if d not in dim_idx]
    size = 1
    for d in dim_idx:
        size *= layout.size(d)
    rows = layout.permute(*other, *dim_idx).reshape(-1, size)
    return [sorted(int(r) for r in row) for row in rows]


_cache_lock = threading.Lock()
_group_cache: dict = {}
_cache_world = [None]  # weakref to the default group the cached groups belong to


def clear_group_cache() -> None:
    """Forget cached flattened groups (done by itself when the default group was destroyed and made again)."""
    with _cache_lock:
        _group_cache.clear()
        _cache_world[0] = None


caches.register("distributed.collectives: flattened groups", clear_group_cache)


def _cache_for_this_world() -> None:
    """The cached groups were made over the current default group, or are dropped: after
    ``destroy_process_group()`` and a new ``init_process_group()`` in one process the new group can even reuse the
    old one's ``id()``, and a cached subgroup of the destroyed world would hang its first collective."""
    world = dist.group.WORLD
    with _cache_lock:
        owner = _cache_world[0]
        if owner is None or owner() is not world:
            _group_cache.clear()
            _cache_world[0] = weakref.ref(world)


def group_of(mesh, dims=None):
    """The ProcessGroup of ``mesh`` over ``dims`` (None = all dims) holding the calling rank.

    One dim: the mesh's own group (``mesh.get_group(dim)``), no new communicator. Several dims: the
    flattened group; WORLD when those dims span exactly the world, else one ``dist.new_group`` per
    subgroup, created in a fixed order on every rank (collective over the default group: call it on
    every rank, with the same arguments, in the same order) and cached per (mesh layout, dims).
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise CollectiveError("accel_fp8_fix: group_of needs an initialised default process group")
    if mesh is None:
        raise CollectiveError("accel_fp8_fix: group_of got no mesh")
    idx = mesh_dims(mesh, dims)
    if not idx:
        raise CollectiveError(f"accel_fp8_fix: no dims selected of mesh {mesh}")
    if mesh.get_coordinate() is None:
        raise CollectiveError(f"accel_fp8_fix: rank {dist.get_rank()} is not part of mesh {mesh}")
    if len(idx) == 1:
        return mesh.get_group(idx[0])
    subgroups = _subgroup_layout(mesh, idx)
    world = dist.get_world_size()
    if len(subgroups) == 1 and subgroups[0] == list(range(world)):
        return dist.group.WORLD
    _cache_for_this_world()
    key = (tuple(tuple(g) for g in subgroups), mesh.device_type)
    with _cache_lock:
        cached = _group_cache.get(key)
    if cached is not None:
        return cached
    me = dist.get_rank()
    mine = None
    for ranks in subgroups:  # same order everywhere: every rank creates every subgroup
        pg = dist.new_group(ranks=ranks)
        if me in ranks:
            mine = pg
    with _cache_lock:
        _group_cache[key] = mine
    return mine


# ------------------------------------------------------------------------------------------------ the core
# Semantics per placement, for a DTensor (``mesh`` defaults to its own mesh):
#   * broadcast / all_reduce act along its *replicated* mesh dims only (``dims=None``): the ranks holding the
#     same shard agree (broadcast) or combine their copies (all_reduce). Naming a dim the DTensor is sharded
#     (or partial) on, or a ``group=`` spanning one, is refused: a shard is not a replica. A DTensor
#     replicated on no dim: nothing to do.
#   * all_gather returns the full tensor (``dims=None``) or the tensor made Replicate on ``dims`` only, as a
#     plain local tensor, through DTensor's own redistribution on its mesh.
# For a plain tensor (or an object) the caller names where it lives: ``mesh`` (and ``dims``, default all) or
# ``group``. A plain tensor is never promoted to a DTensor on the caller's behalf: promotion
# (``DTensor.from_local(t, mesh, [Replicate()])``) asserts that every rank holds the same value, which is false
# for a shard, a per-rank gradient or an amax, and the result would be silently wrong instead of an error.
_TENSOR, _VARIABLE, _OBJECT = "tensor", "variable", "object"  # what _resolve is asked to move
_NO_DTENSOR = {
    _VARIABLE: "DTensors have a fixed global shape; use broadcast",
    _OBJECT: "pickling one would ship a shard and its mesh; use broadcast on a replica",
}


def _placement_kind(placement) -> str:
    if placement.is_replicate():
        return "replicate"
    if placement.is_partial():
        return "partial"
    return "shard"  # Shard, _StridedShard and anything else that is not a replica


def _dtensor_dims(tensor, mesh, dims, op: str, label: str):
    """(mesh, dim indices) on the DTensor's own mesh: ``dims`` (names/indices) or its replicated dims."""
    dt_mesh = tensor.device_mesh
    if mesh is not None and mesh != dt_mesh:
        names = tuple(mesh.mesh_dim_names or ())
        own = tuple(dt_mesh.mesh_dim_names or ())
        if not names or not set(names) <= set(own) or dims is not None:
            raise CollectiveError(
                f"accel_fp8_fix: {op} of DTensor {label}: mesh {mesh} is not its device mesh {dt_mesh}; pass its "
                "own mesh (or none) and dims= by name"
            )
        dims = names  # a sub-mesh of the DTensor's mesh, e.g. mesh["dp_shard"]: its dims, by name
    if dims is None:
        return dt_mesh, tuple(d for d, p in enumerate(tensor.placements) if p.is_replicate())
    return dt_mesh, mesh_dims(dt_mesh, dims)


def _refuse_sharded_span(tensor, group, label: str, op: str) -> None:
    """Refuse a DTensor whose non-replicated mesh dims ``group`` spans (or whose mesh excludes this rank)."""
    dt_mesh = getattr(tensor, "device_mesh", None)
    if dt_mesh is None or dt_mesh.get_coordinate() is None:
        raise CollectiveError(
            f"accel_fp8_fix: {op} of DTensor {label}: rank {dist.get_rank()} is not part of its mesh "
            f"{dt_mesh}; no usable mesh"
        )
    members = set(group_ranks(group))
    layout = dt_mesh.mesh
    for d, placement in enumerate(tuple(getattr(tensor, "placements", ()))):
        kind = _placement_kind(placement)
        if kind == "replicate":
            continue
        coords = set()
        for r in members:
            hit = (layout == r).nonzero()
            if hit.numel():
                coords.add(int(hit[0][d]))
        if len(coords) > 1:
            dim_name = (dt_mesh.mesh_dim_names or [None] * dt_mesh.ndim)[d]
            raise CollectiveError(
                f"accel_fp8_fix: refusing to {op} DTensor {label} over ranks {sorted(members)}: it is "
                f"{placement} on mesh dim {dim_name or d} and that group spans that dim; a "
                f"{'shard' if kind == 'shard' else 'partial value'} is not a replica. Use a group orthogonal "
                "to the sharding (dims= the replicated dims), or gather it first (full_tensor())."
            )


def _refuse_arguments(value, mesh, dims, group, label: str, op: str, payload: str) -> None:
    """What is wrong with the arguments alone (checked before the process group is looked at)."""
    if is_dtensor(value) and payload != _TENSOR:
        raise CollectiveError(f"accel_fp8_fix: {op} of DTensor {label}: {_NO_DTENSOR[payload]}")
    if group is not None and (mesh is not None or dims is not None):
        raise CollectiveError(f"accel_fp8_fix: {op} of {label}: pass either group= or mesh=/dims=, not both")
    if is_dtensor(value):
        return
    if payload == _TENSOR and not isinstance(value, torch.Tensor):
        raise CollectiveError(f"accel_fp8_fix: {op} of {label}: expected a tensor, got {type(value).__name__}")
    if group is None and mesh is None:
        what = "a plain tensor" if isinstance(value, torch.Tensor) else "it"
        raise CollectiveError(
            f"accel_fp8_fix: {op} of {label}: {what} needs the mesh (and dims) or group= it is moved over "
            "(nothing defaults to WORLD; pass group=torch.distributed.group.WORLD to mean it)."
            + (" It is not promoted to a DTensor: that would assume it is replicated, which is wrong for a shard"
               if payload == _TENSOR else "")
        )
    if dims is not None and mesh is None:
        raise CollectiveError(f"accel_fp8_fix: {op} of {label}: dims= needs mesh= (or a DTensor)")


def _resolve(value, mesh, dims, group, name: str | None, op: str, payload: str = _TENSOR):
    """THE resolution of every collective here: (what moves through c10d, its process group).

    ``payload``: ``"tensor"`` (a plain tensor, or a DTensor whose local tensor moves), ``"variable"`` (a plain
    tensor or None: only src knows the shape), ``"object"`` (anything picklable but a DTensor). The group is
    ``group``, else ``group_of(mesh, dims)``, else (DTensor) its own mesh over ``dims`` or, ``dims=None``, its
    replicated dims; ``(local, None)`` when such a DTensor is replicated on no dim (nothing to do).
    """
    label = _label(name, value)
    _refuse_arguments(value, mesh, dims, group, label, op, payload)
    if not (dist.is_available() and dist.is_initialized()):
        raise CollectiveError(f"accel_fp8_fix: {op} of {label}: no default process group is initialised")
    if is_dtensor(value):
        local = value.to_local()
        if group is None:
            dt_mesh, idx = _dtensor_dims(value, mesh, dims, op, label)
            if not idx:
                return local, None  # replicated on no mesh dim: every rank holds a distinct shard
            group = group_of(dt_mesh, idx)
        _refuse_sharded_span(value, group, label, op)
    else:
        local = value
        group = group if group is not None else group_of(mesh, dims)
    if payload == _TENSOR and local.device.type == "meta":
        raise CollectiveError(f"accel_fp8_fix: {op} of {label}: the tensor is on the meta device (no data)")
    me = dist.get_rank()
    if me not in group_ranks(group):
        raise CollectiveError(
            f"accel_fp8_fix: {op} of {label}: calling rank {me} is not in the group {list(group_ranks(group))}"
        )
    return local, group


def _src_in_group(group, src: int, label: str, op: str) -> int:
    ranks = group_ranks(group)
    if src not in ranks:
        raise CollectiveError(
            f"accel_fp8_fix: {op} of {label}: src={src} (a global rank) is not in the group {list(ranks)}"
        )
    return dist.get_group_rank(group, src)


def _group_src(group, src, group_src, label, op) -> int:
    """The root as ``group``'s rank: ``src`` (a GLOBAL rank, checked in the group) or ``group_src`` (default 0)."""
    if src is not None and group_src is not None:
        raise CollectiveError(f"accel_fp8_fix: {op} of {label}: pass src= (a global rank) or group_src=, not both")
    if src is not None:
        return _src_in_group(group, src, label, op)
    group_src = 0 if group_src is None else group_src
    size = len(group_ranks(group))
    if not 0 <= group_src < size:
        raise CollectiveError(f"accel_fp8_fix: {op} of {label}: group_src={group_src} is outside a group of {size}")
    return group_src


def _broadcast_plain(local: torch.Tensor, group, group_src: int) -> None:
    if local.is_contiguous():
        dist.broadcast(local, group=group, group_src=group_src)
    else:  # gloo / nccl want contiguous buffers; copy back into the strided view afterwards
        buf = local.contiguous()
        dist.broadcast(buf, group=group, group_src=group_src)
        local.copy_(buf)


def _all_reduce_local(local: torch.Tensor, op, group) -> None:
    """All-reduce a plain (local) tensor in place on ``group``, through a contiguous buffer if need be."""
    if local.is_contiguous():
        dist.all_reduce(local, op=op, group=group)
    else:
        buf = local.contiguous()
        dist.all_reduce(buf, op=op, group=group)
        local.copy_(buf)


# ------------------------------------------------------------------------------------------------ public
def broadcast(tensor, mesh=None, dims=None, *, src: int | None = None, group_src: int | None = None, group=None,
              name: str | None = None):
    """Broadcast ``tensor`` in place and return it.

    DTensor: along its replicated mesh dims (or ``dims``, which must be replicated), its local tensor, from
    the first rank of each group (``group_src``, default 0, or ``src`` = a GLOBAL rank); ``group=`` must not
    span a sharded dim. Plain tensor: over ``mesh`` (``dims`` default all) or ``group``. Every rank of the
    group calls it with the same shape and dtype.
    """
    local, group = _resolve(tensor, mesh, dims, group, name, "broadcast")
    if group is None:
        return tensor
    root = _group_src(group, src, group_src, _label(name, tensor), "broadcast")
    with torch.no_grad():
        _broadcast_plain(local, group, root)
    return tensor


def all_reduce(tensor, mesh=None, dims=None, *, op=None, group=None, name: str | None = None):
    """All-reduce ``tensor`` in place (``op`` default SUM) and return it.

    DTensor: its local tensor along its replicated mesh dims (or ``dims``, which must be replicated): the
    replicas combine their values, shards are never summed into each other. Plain tensor: over ``mesh``
    (``dims`` default all) or ``group``.
    """
    local, group = _resolve(tensor, mesh, dims, group, name, "all_reduce")
    if group is None:
        return tensor
    with torch.no_grad():
        _all_reduce_local(local, dist.ReduceOp.SUM if op is None else op, group)
    return tensor


def _gather_dtensor(tensor, mesh, dims, label: str) -> torch.Tensor:
    from torch.distributed.tensor import Replicate

    dt_mesh = tensor.device_mesh
    if mesh is not None and mesh != dt_mesh:
        dt_mesh, idx = _dtensor_dims(tensor, mesh, None, "all_gather", label)
    else:
        idx = tuple(range(dt_mesh.ndim)) if dims is None else mesh_dims(dt_mesh, dims)
    if dt_mesh.get_coordinate() is None:
        raise CollectiveError(f"accel_fp8_fix: all_gather of DTensor {label}: rank {dist.get_rank()} is not in its mesh")
    placements = [Replicate() if d in idx else p for d, p in enumerate(tensor.placements)]
    with torch.no_grad():
        return tensor.detach().redistribute(dt_mesh, placements).to_local()


def all_gather(tensor, mesh=None, dims=None, *, group=None, name: str | None = None) -> torch.Tensor:
    """Gather and return a plain tensor (``tensor`` is not modified).

    DTensor: the full global tensor (``dims=None``), or the tensor made Replicate on ``dims`` only (its other
    placements kept), as this rank's local tensor; partial values are reduced. The DTensor's own
    redistribution does it on its mesh's groups (functional collectives on local tensors). Plain tensor:
    every rank's tensor over ``mesh``/``dims`` or ``group``, stacked in group-rank order: shape
    ``(group size, *tensor.shape)``; all ranks pass the same shape.
    """
    label = _label(name, tensor)
    if is_dtensor(tensor):
        if group is not None:
            raise CollectiveError(
                f"accel_fp8_fix: all_gather of DTensor {label}: group= is for plain tensors; a DTensor is gathered "
                "on its own mesh (dims=)"
            )
        return _gather_dtensor(tensor, mesh, dims, label)
    local, group = _resolve(tensor, mesh, dims, group, name, "all_gather")
    out = torch.empty((len(group_ranks(group)), *local.shape), dtype=local.dtype, device=local.device)
    with torch.no_grad():
        dist.all_gather(list(out.unbind(0)), local.contiguous(), group=group)
    return out


_DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8, torch.int16,
    torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128,
    *(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                                   "float8_e8m0fnu", "uint16", "uint32", "uint64") if hasattr(torch, n)),
)
_HEADER = 16  # [ndim, dtype index, shape...]


def _variable_header(tensor, label: str, device) -> torch.Tensor:
    """The int64 header ``[ndim, dtype index, *shape]`` src sends first."""
    if not isinstance(tensor, torch.Tensor):
        raise CollectiveError(f"accel_fp8_fix: broadcast_variable of {label}: src has no tensor to send")
    if tensor.device.type == "meta":
        raise CollectiveError(f"accel_fp8_fix: broadcast_variable of {label}: src tensor is on meta")
    if tensor.dim() > _HEADER - 2 or tensor.dtype not in _DTYPES:
        raise CollectiveError(
            f"accel_fp8_fix: broadcast_variable of {label}: unsupported {tensor.dim()}-d {tensor.dtype} tensor"
        )
    header = torch.zeros(_HEADER, dtype=torch.int64, device=device)
    header[0] = tensor.dim()
    header[1] = _DTYPES.index(tensor.dtype)
    if tensor.dim():
        header[2 : 2 + tensor.dim()] = torch.tensor(tuple(tensor.shape), dtype=torch.int64)
    return header


def broadcast_variable(tensor, mesh=None, dims=None, *, src: int | None = None, group_src: int | None = None,
                       group=None, name: str | None = None, device=None) -> torch.Tensor:
    """Broadcast a plain tensor whose shape / dtype only the root knows (e.g. TE ``_extra_state`` bytes).

    Root: ``src`` (a GLOBAL rank) or ``group_src`` (default 0), as for :func:`broadcast`. A fixed-size int64
    header ``[ndim, dtype, *shape]`` goes first, then the payload (skipped when empty). On the root ``tensor``
    is the payload; elsewhere it may be None or any tensor (its device is used unless ``device=``). Returns the
    received tensor (``tensor`` itself, contiguous, on the root).
    """
    label = _label(name, tensor)
    _, group = _resolve(tensor, mesh, dims, group, name, "broadcast_variable", _VARIABLE)
    root = _group_src(group, src, group_src, label, "broadcast_variable")
    if device is None:
        device = tensor.device if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta" else "cpu"
    device = torch.device(device)
    is_root = dist.get_rank() == dist.get_global_rank(group, root)
    header = _variable_header(tensor, label, device) if is_root else torch.zeros(_HEADER, dtype=torch.int64,
                                                                                device=device)
    with torch.no_grad():
        dist.broadcast(header, group=group, group_src=root)
        ndim, dtype = int(header[0]), _DTYPES[int(header[1])]
        shape = tuple(int(s) for s in header[2 : 2 + ndim])
        out = tensor.detach().to(device).contiguous() if is_root else torch.empty(shape, dtype=dtype, device=device)
        if out.numel():
            dist.broadcast(out, group=group, group_src=root)
    return out


def broadcast_object(obj: Any, mesh=None, dims=None, *, src: int | None = None, group_src: int | None = None,
                     group=None, name: str | None = None, device=None) -> Any:
    """Broadcast a picklable object from the root (``src`` GLOBAL rank or ``group_src``, default 0); returns it.

    DTensors are refused (pickling one would ship a shard plus its mesh). ``io.BytesIO`` travels as bytes.
    """
    label = _label(name, obj)
    _, group = _resolve(obj, mesh, dims, group, name, "broadcast_object", _OBJECT)
    root = _group_src(group, src, group_src, label, "broadcast_object")
    payload = [obj.getvalue() if isinstance(obj, io.BytesIO) else obj, isinstance(obj, io.BytesIO)]
    if dist.get_rank() != dist.get_global_rank(group, root):
        payload = [None, None]
    dist.broadcast_object_list(payload, group=group, group_src=root, device=device)
    value, was_bytesio = payload
    return io.BytesIO(value) if was_bytesio else value


def all_gather_object(obj: Any, mesh=None, dims=None, *, group=None, name: str | None = None) -> list:
    """Every rank's ``obj`` (not a DTensor) over ``mesh``/``dims`` or ``group``, in group-rank order."""
    _, group = _resolve(obj, mesh, dims, group, name, "all_gather_object", _OBJECT)
    out = [None] * len(group_ranks(group))
    dist.all_gather_object(out, obj, group=group)
    return out


def barrier_async(group):
    """Issue a barrier on ``group`` (a ProcessGroup: named, never the implied default) without waiting; returns its
    Work (``work.wait(timeout=...)``). On gloo it completes only after every collective queued or running on the
    group when it was issued (``ProcessGroupGloo::barrier``)."""
    if group is None:
        raise CollectiveError("accel_fp8_fix: barrier_async: name the group (pass group=dist.group.WORLD for all)")
    return dist.barrier(group=group, async_op=True)
