"""Sharded (DCP) checkpoints of TP-packed parameters (A16 in docs/failures.md).

transformers' ``packed_colwise`` TP style (Qwen3-MoE's fused expert ``gate_up_proj`` ``[E, 2I, H]``) shards the
packed dim with ``_StridedShard(1, sf=2)`` on ``tp``: a rank holds its slice of the gate half *and* of the up
half, two row ranges of the global tensor stacked in one local tensor. DTensor describes its local tensor to
torch DCP as one chunk (one offset, one size), so two ranks' chunks overlap and the planner fails ("overlapping
chunks") — after the other ranks started writing.

Here, inside ``save_state`` / ``load_state``, the state dicts DCP reads (the model's ``state_dict``, the
optimizers' ``state_dict``: what accelerate's FSDP2 path and this package's TP path hand to DCP) carry each such
DTensor as a new DTensor on the same local storage whose local tensor answers DCP's checkpoint hooks itself:
one chunk per box of the global tensor this rank holds (e.g. ``[0:E, r*I/tp : (r+1)*I/tp, :]`` and
``[0:E, I + r*I/tp : ..., :]``), each with its true global offset, each read / written through a view of the
local tensor. The checkpoint holds the parameter under its own key, global shape and dtype, as any other: it
loads on another layout or world size (DCP reshards), into a model without TP or FP8, and
``dcp_to_torch_save`` gives the full tensor. The boxes are found with DTensor's own sharding (each tensor dim's
global indices, distributed like the parameter with no communication), so any placement torch can distribute
is described as it lays data out. Every other tensor is left as it is.
"""

from __future__ import annotations

import contextlib
import itertools

from ...distributed.dtensor import is_dtensor
from ...internals.accelerate_internals import prepared_models, prepared_optimizers
from ...internals.torch_internals import is_strided_shard, placement_on_dim, sharded_dim, with_local_chunks


def _global_indices(dtensor, dim: int) -> list[int]:
    """The global indices along ``dim`` of this rank's local tensor, in local order (DTensor's own split of an
    ``arange``, placements on other dims replaced by ``Replicate``: local, no communication)."""
    import torch
    from torch.distributed.tensor import Replicate, distribute_tensor

    ndim = dtensor.ndim
    placements = [placement_on_dim(p, 0) if sharded_dim(p) is not None and sharded_dim(p) % ndim == dim
                  else Replicate() for p in dtensor.placements]
    with torch.no_grad():
        index = torch.arange(dtensor.shape[dim], device=dtensor.to_local().device)
        return distribute_tensor(index, dtensor.device_mesh, placements, src_data_rank=None).to_local().tolist()


def _runs(indices: list[int]) -> list[list[int]]:
    """[[global start, local start, length]] of the consecutive stretches of ``indices``."""
    runs: list[list[int]] = []
    for local, index in enumerate(indices):
        if runs and runs[-1][0] + runs[-1][2] == index:
            runs[-1][2] += 1
        else:
            runs.append([index, local, 1])
    return runs


def local_boxes(dtensor) -> list[tuple[tuple, tuple, tuple]] | None:
    """[(global offsets, local offsets, sizes)] of the boxes of the global tensor this rank's local tensor holds,
    when it holds more than one (a ``_StridedShard`` that splits a dim into separate stretches); None when DTensor's
    own one-chunk description is right. ``ValueError`` if DTensor's split disagrees with the local shape."""
    if dtensor.device_mesh.get_coordinate() is None or not any(is_strided_shard(p) for p in dtensor.placements):
        return None
    local_shape = tuple(dtensor.to_local().shape)
    per_dim = []
    for dim in range(dtensor.ndim):
        indices = _global_indices(dtensor, dim)
        if len(indices) != local_shape[dim]:
            raise ValueError(f"dim {dim} holds {local_shape[dim]} rows locally but its placements "
                             f"{dtensor.placements} give {len(indices)}")
        per_dim.append(_runs(indices))
    if all(len(runs) <= 1 for runs in per_dim):
        return None
    return [tuple(tuple(r[i] for r in box) for i in range(3)) for box in itertools.product(*per_dim)]


def _packed_on_tp(dtensor) -> bool:
    """A ``_StridedShard`` on the ``tp`` mesh dim: TP's packed layout (transformers' ``packed_colwise``)."""
    names = dtensor.device_mesh.mesh_dim_names or ()
    return any(n == "tp" and is_strided_shard(p) for n, p in zip(names, dtensor.placements))


def describe(dtensor, name: str):
    """``dtensor`` as DCP should see it: itself when one chunk describes it, else a DTensor on the same storage
    whose local tensor names one chunk per box. Only TP-packed DTensors (``_StridedShard`` on ``tp``) are looked
    at; one whose boxes cannot be found is refused (``ValueError`` naming ``name``) before DCP writes or reads
    anything."""
    if not _packed_on_tp(dtensor):
        return dtensor  # e.g. FSDP2's own _StridedShard over TP: one chunk, DTensor's own, as before
    try:
        boxes = local_boxes(dtensor)
    except Exception as exc:  # noqa: BLE001 — any failure to find the boxes: refused by name, nothing written
        raise ValueError(
            f"accel_fp8_fix: a sharded (DCP) checkpoint cannot describe {name} ({dtensor.placements} on "
            f"{dtensor.device_mesh.mesh_dim_names}): {exc} (A16). Save it with accelerator.save_model (full tensors), "
            "fsdp_state_dict_type FULL_STATE_DICT, or without TP.") from exc
    if boxes is None:
        return dtensor
    return _with_boxes(dtensor, boxes)


def _with_boxes(dtensor, boxes):
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    properties = TensorProperties.create_from_tensor(dtensor.to_local())
    chunks = [ChunkStorageMetadata(offsets=torch.Size(g), sizes=torch.Size(s)) for g, _, s in boxes]
    views = {torch.Size(g): (local, sizes) for g, local, sizes in boxes}

    def write_items(fqn, obj):
        return [WriteItem(index=MetadataIndex(fqn, c.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=c, properties=properties, size=obj.size()))
                for c in chunks]

    def shard(local, index):
        start, sizes = views[torch.Size(index.offset)]
        for dim, (s, n) in enumerate(zip(start, sizes)):
            local = local.narrow(dim, s, n)
        return local

    return with_local_chunks(dtensor, lambda: list(chunks), write_items, shard)


def _model_hook(module, state_dict, prefix, local_metadata) -> None:
    for key, value in list(state_dict.items()):
        if key.startswith(prefix) and is_dtensor(value):
            state_dict[key] = describe(value, key)


def _optimizer_hook(optimizer, state_dict):
    """Each parameter's state in a new dict (the packed one shares the optimizer's live dicts)."""
    for key, states in list(state_dict.get("state", {}).items()):
        if any(is_dtensor(v) for v in states.values()):
            state_dict["state"][key] = {k: describe(v, f"optimizer state {k!r} of parameter {key}") if is_dtensor(v)
                                        else v for k, v in states.items()}
    return state_dict


def _optimizers(accelerator) -> list:
    return [getattr(o, "optimizer", o) for o in prepared_optimizers(accelerator)]


@contextlib.contextmanager
def described_packed_parameters(accelerator):
    """Inside ``save_state`` / ``load_state``: every prepared model's and optimizer's ``state_dict`` describes each
    TP-packed DTensor as DCP needs it (one chunk per box this rank holds); nothing changes outside."""
    handles = []
    models = [m for m in prepared_models(accelerator)
              if any(is_dtensor(p) and _packed_on_tp(p) for p in m.parameters())]
    try:
        for model in models:
            handles.append(model.register_state_dict_post_hook(_model_hook))
        if models:
            for optimizer in _optimizers(accelerator):
                handles.append(optimizer.register_state_dict_post_hook(_optimizer_hook))
        yield
    finally:
        for handle in handles:
            handle.remove()
