"""The TP layout of each Linear / LayerNorm, noted before FSDP2 adds its dims (``record_tp_layout``) in the module's
record (fixes/convert/run_state.py) and read back with :func:`tp_layout_of` by the conversion, the TP fix and
prepare; the mesh facts it reads (data-parallel dims, FSDP2's placements) are distributed/mesh_facts.py's.
"""

from __future__ import annotations

from torch import nn

from ...distributed.dtensor import is_dtensor
from ...distributed.mesh_facts import DATA_PARALLEL_DIMS, TP_DIM, dim_names, is_fsdp_placement
from .run_state import module_record, module_record_of


def tp_layout_of(module: nn.Module) -> tuple:
    """(parallel_mode, tp_mesh) noted for ``module``; (None, None) when it has none."""
    found = module_record_of(module)
    return found.tp_mode, found.tp_mesh


def is_output_layer(module: nn.Module) -> bool:
    """The model's output embedding (lm_head), noted by :func:`record_tp_layout`: kept as transformers shards it."""
    return module_record_of(module).output_layer


def tp_placement(name: str, weight) -> tuple:
    """(placement on the TP dim, the TP mesh) of a weight sharded before prepare: TP only (a 1-D mesh), or TP
    and FSDP2 both applied at load by transformers (``DistributedConfig(tp_size, fsdp_size)``: mesh dims
    ``fsdp`` x ``tp``, the FSDP dim sharding dim 0 or replicating)."""
    placements, mesh = weight.placements, weight.device_mesh
    names = dim_names(mesh)
    if names and set(names) <= set(DATA_PARALLEL_DIMS) and all(is_fsdp_placement(p) for p in placements):
        return None, None  # FSDP2 only (transformers' TP plan left it whole): no TP layout to record
    if len(placements) == 1:
        return placements[0], mesh  # TP on a 1-D mesh ('tp', or the user's own)
    if TP_DIM not in names:
        raise ValueError(
            f"accel_fp8_fix: {name}.weight is a DTensor on a {len(placements)}-D mesh {names or ''} before prepare "
            "with no dim named 'tp'; expected TP sharding on a 'tp' dim (plus FSDP's, when transformers sharded both)")
    tp_dim = names.index(TP_DIM)
    for dim, placement in enumerate(placements):
        if dim != tp_dim and not is_fsdp_placement(placement):
            raise ValueError(f"accel_fp8_fix: {name}.weight has placement {placement} on mesh dim {names[dim]!r}; "
                             "only FSDP's Shard(0) or Replicate is expected beside 'tp'")
    return placements[tp_dim], mesh[TP_DIM]


def record_tp_layout(model: nn.Module) -> dict:
    """Note, before FSDP2 adds its own dims (or from the 'tp' dim when transformers sharded TP and FSDP2 at
    load), how TP shards each Linear / LayerNorm: {name: parallel_mode}."""
    from torch.distributed.tensor import Replicate, Shard

    layout = {}
    for name, module in model.named_modules():
        if not isinstance(module, (nn.Linear, nn.LayerNorm)) or not is_dtensor(getattr(module, "weight", None)):
            continue
        placement, tp_mesh = tp_placement(name, module.weight)
        if tp_mesh is None:
            continue
        if isinstance(placement, Replicate):
            mode = None
        elif isinstance(module, nn.Linear) and isinstance(placement, Shard) and placement.dim in (0, 1):
            mode = "column" if placement.dim == 0 else "row"
        else:
            raise ValueError(f"accel_fp8_fix: {name}.weight has placement {placement}, which TE's TP cannot express")
        noted = module_record(module)
        noted.tp_mode, noted.tp_mesh = mode, tp_mesh
        layout[name] = mode
    output_layer = getattr(model, "get_output_embeddings", lambda: None)()
    if isinstance(output_layer, nn.Module):
        module_record(output_layer).output_layer = True
    return layout
