"""What the fixes know about a device mesh, in one place: the dim names accelerate and transformers give, which
dims are data-parallel (never TP), FSDP2's own placements, and the dims of the FP8 amax reduction group. Read by
the conversion, the MoE experts, the TP layout, the pre-sharded check, the EP checkpoint and prepare."""

from __future__ import annotations

from ..internals import torch_internals

TP_DIM = "tp"  # accelerate's and transformers' tensor-parallel dim
EP_DIM = "ep"  # transformers' expert mesh: (pp, dp_replicate, efsdp, ep)
FSDP_DIM_NAMES = ("fsdp", "dp_shard", "dp_shard_cp")  # transformers' name, accelerate's names
DATA_PARALLEL_DIMS = (*FSDP_DIM_NAMES, "dp_replicate", "dp_cp", "dp")  # mesh dims that never carry TP


def dim_names(mesh) -> tuple:
    """The mesh's dim names; () for an unnamed mesh (accelerate's plain FSDP2 mesh)."""
    return tuple(mesh.mesh_dim_names or ())


def is_fsdp_placement(placement) -> bool:
    """FSDP2's placement: Shard(0), _StridedShard(0) (FSDP2 over TP's Shard(0)) or Replicate (HSDP)."""
    from torch.distributed.tensor import Replicate

    shard0 = getattr(placement, "dim", None) == 0 and (placement.is_shard() or torch_internals.is_strided_shard(placement))
    return shard0 or isinstance(placement, Replicate)


def amax_group_dims(mesh) -> tuple | None:
    """The dims of the FP8 amax reduction group: every dim of the mesh (dp x cp x tp flattened); None for an
    unnamed mesh (its whole group)."""
    return tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None
