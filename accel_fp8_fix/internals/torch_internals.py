"""torch internals outside FSDP2's parameter records (``torch_fsdp2``): DTensor's ``_StridedShard``, the composable
APIs' per-module ``_State``, ``CheckpointWrapper``'s private module, c10d's default store, and the tensor
globals a torch pickle names.

- ``torch.distributed.tensor.placement_types._StridedShard``: recognised by class name (never imported), and
  re-created on another tensor dim (``type(p)(dim, split_factor=...)``) to find the global rows a rank holds;
- DTensor's checkpoint protocol: ``DTensor.__create_write_items__`` / ``__create_chunk_list__`` /
  ``__get_tensor_shard__`` defer to its local tensor's when it has them (torch's ``LocalShardsWrapper`` path),
  which lets one rank describe its local tensor to DCP as several chunks (A16);
- ``torch.distributed._composable_state._State``: FSDP2's / replicate's per-module state (TE caches it on
  its modules as ``_te_cached_parent_fsdp_state``), never walked as a module's own state;
- ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper.CheckpointWrapper`` (accelerate's FSDP2
  ``activation_checkpointing``; its ``checkpoint_fn``);
- ``torch.distributed.distributed_c10d._get_default_store()`` (the default group's key-value store);
- ``torch.distributed.distributed_c10d._world.pg_map``: every process group this rank belongs to (the exit
  handler drains each gloo group before destroying them, ``fixes/start/clean_exit.py``);
- ``torch._utils._rebuild_tensor_v2`` / ``torch.storage._load_from_bytes``: the globals a pickled tensor names
  (TE's extra state), for a restricted unpickler;
- ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``: where a DTensor's local shard starts in
  the global tensor (a packed-experts weight's first expert on this rank, ``_StridedShard`` included);
- ``DeviceMesh._flatten()``: one process group over several mesh dims (the ranks holding the same experts under
  transformers' expert parallelism with HSDP: ``dp_replicate`` x ``efsdp``).
"""

from __future__ import annotations

STRIDED_SHARD = "_StridedShard"
_COMPOSABLE_STATE = ("torch.distributed._composable_state", "_State")
_CHECKPOINT_WRAPPER_MODULE = "torch.distributed.algorithms._checkpoint.checkpoint_wrapper"
# (file under torch/, text that must be in it): read, not imported.
_SOURCES = (
    ("distributed/tensor/placement_types.py", f"class {STRIDED_SHARD}("),
    ("distributed/tensor/_api.py", 'hasattr(self._local_tensor, "__create_write_items__")'),
    ("distributed/tensor/_api.py", 'hasattr(self._local_tensor, "__create_chunk_list__")'),
    ("distributed/tensor/_api.py", 'hasattr(self._local_tensor, "__get_tensor_shard__")'),
    ("distributed/_composable_state.py", "class _State"),
    ("distributed/algorithms/_checkpoint/checkpoint_wrapper.py", "class CheckpointWrapper("),
    ("distributed/algorithms/_checkpoint/checkpoint_wrapper.py", "self.checkpoint_fn"),
    ("distributed/distributed_c10d.py", "def _get_default_store("),
    ("distributed/distributed_c10d.py", "def pg_map(self)"),
    ("distributed/distributed_c10d.py", "_world = _World()"),
    ("_utils.py", "def _rebuild_tensor_v2("),
    ("distributed/tensor/_utils.py", "def compute_local_shape_and_global_offset("),
    ("storage.py", "def _load_from_bytes("),
    ("distributed/device_mesh.py", "def _flatten("),
)


def check(versions) -> list[str]:
    from . import check_sources

    return check_sources("torch", versions, _SOURCES)


def is_strided_shard(placement) -> bool:
    """``placement`` is DTensor's ``_StridedShard`` (a shard of a shard: FSDP2 over TP, or TP's packed layout)."""
    return type(placement).__name__ == STRIDED_SHARD


def sharded_dim(placement) -> int | None:
    """The tensor dim ``placement`` shards (``Shard`` or ``_StridedShard``, which is no ``Shard`` and whose
    ``is_shard()`` is False in torch 2.13); None for ``Replicate`` / ``Partial``."""
    if placement.is_shard() or is_strided_shard(placement):
        return placement.dim
    return None


def placement_on_dim(placement, dim: int):
    """``placement`` (``Shard`` or ``_StridedShard``, split factor kept) acting on tensor dim ``dim`` instead."""
    from torch.distributed.tensor import Shard

    if is_strided_shard(placement):
        return type(placement)(dim, split_factor=int(placement.split_factor))
    return Shard(dim)


def with_local_chunks(dtensor, chunks, write_items, shard):
    """A DTensor equal to ``dtensor`` (a new object on the same local storage, mesh, placements, shape) that torch
    DCP sees as the chunks its local tensor answers: DTensor defers ``__create_chunk_list__`` (``chunks()``),
    ``__create_write_items__`` (``write_items(fqn, obj)``) and ``__get_tensor_shard__`` (``shard(index)``) to its
    local tensor when it has them — the hooks torch's ``LocalShardsWrapper`` provides. The callables are given
    the new local tensor (a weak reference: no cycle keeps it alive)."""
    import weakref

    import torch
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        alias = DTensor.from_local(dtensor.to_local(), dtensor.device_mesh, dtensor.placements, run_check=False,
                                   shape=dtensor.shape, stride=dtensor.stride())
        local = alias.to_local()  # no grad: the very local tensor of ``alias``
    ref = weakref.ref(local)
    local.__create_chunk_list__ = lambda: chunks()
    local.__create_write_items__ = lambda fqn, obj: write_items(fqn, obj)
    local.__get_tensor_shard__ = lambda index: shard(ref(), index)
    return alias


def is_composable_state(obj) -> bool:
    """``obj`` is a composable API's (FSDP2's, replicate's) per-module state."""
    module, name = _COMPOSABLE_STATE
    return any(c.__name__ == name and c.__module__ == module for c in type(obj).__mro__)


def checkpoint_wrapper_type():
    """torch's ``CheckpointWrapper`` class (``()`` when this torch has none: ``isinstance`` is then False)."""
    import importlib

    try:
        return importlib.import_module(_CHECKPOINT_WRAPPER_MODULE).CheckpointWrapper
    except (ImportError, AttributeError):  # pragma: no cover
        return ()


def default_store():
    """The default process group's key-value store."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


def process_groups() -> list:
    """Every process group this rank belongs to (the default group and every subgroup: DeviceMesh's, TP's, the
    package's own), in creation order."""
    from torch.distributed import distributed_c10d

    return list(distributed_c10d._world.pg_map)


def pickled_tensor_globals(load_storage) -> dict:
    """{(module, name): callable} for the globals a pickled tensor names: ``_rebuild_tensor_v2`` itself and
    ``load_storage(data)`` standing in for ``torch.storage._load_from_bytes`` (which loads with
    ``weights_only=False``)."""
    import torch

    return {
        ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
        ("torch.storage", "_load_from_bytes"): load_storage,
    }


def flatten_mesh(mesh):
    """``mesh`` (several dims) as one flattened 1-D mesh (``DeviceMesh._flatten``); every rank calls it alike."""
    return mesh._flatten()


def global_row_offset(dtensor) -> int:
    """The global index along dim 0 of this rank's first local row of ``dtensor`` (0 for a plain tensor)."""
    if not hasattr(dtensor, "device_mesh"):
        return 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(dtensor.shape, dtensor.device_mesh, dtensor.placements)
    return int(offset[0]) if offset else 0
