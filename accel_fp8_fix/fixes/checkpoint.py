"""FP8 state through checkpoints (A7, A13 in docs/failures.md): identical on every rank before a save
(whichever rank's copy the writer keeps) and after a load (broadcast from the mesh's first rank)."""

from __future__ import annotations

from ..internals.accelerate_internals import prepared_models
from .fp8_state import broadcast_fp8_state, reduce_pending_amax


def _fp8_setup(accelerator):
    setup = getattr(accelerator, "accel_fp8_fix", None)
    if setup is not None and setup.fp8_enabled and setup.amax_group is not None:
        return setup
    return None


def _reduce_pending(accelerator, models) -> None:
    setup = _fp8_setup(accelerator)
    if setup is not None:
        for model in models:
            reduce_pending_amax(model, setup.amax_group)


def strided_tp_parameters(model) -> list:
    """Names of parameters TP shards with ``_StridedShard`` (transformers' ``packed_colwise``: Qwen3-MoE's
    fused expert ``gate_up_proj``). A rank holds two separate row ranges of such a parameter, which one DCP
    chunk (offset + size) cannot describe: torch's planner reports overlapping chunks (A16)."""
    names = []
    for name, param in model.named_parameters():
        placements = getattr(param, "placements", ())
        dims = getattr(getattr(param, "device_mesh", None), "mesh_dim_names", None) or ()
        for dim_name, placement in zip(dims, placements):
            if dim_name == "tp" and type(placement).__name__ == "_StridedShard":
                names.append(name)
    return names


def _refuse_strided_sharded_save(accelerator, models) -> None:
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if plugin is None or "SHARDED" not in str(getattr(plugin, "state_dict_type", "")):
        return
    for model in models:
        names = strided_tp_parameters(model)
        if names:
            raise ValueError(
                f"accel_fp8_fix: save_state cannot write a sharded (DCP) checkpoint of {names[0]}"
                f"{f' and {len(names) - 1} more' if len(names) > 1 else ''}: tensor parallelism packs it "
                "(_StridedShard on 'tp'), so each rank holds two row ranges that one DCP chunk cannot describe "
                "(torch's planner would fail with 'overlapping chunks' after the other ranks started writing). "
                "Use fsdp_state_dict_type FULL_STATE_DICT for this model, or save without TP."
            )


def _checkpoint_fp8_state(module, prefix=None, keep_vars=None) -> None:
    module.fp8_meta["fp8_checkpoint"] = True


def keep_fp8_state_in_checkpoints(module) -> None:
    """A TE module's ``get_extra_state`` returns an empty tensor unless its last forward ran in FP8
    (``fp8_meta["fp8_checkpoint"]``, reset by every forward): after an evaluation pass in eval mode (no FP8
    autocast) a checkpoint would drop every scale and amax history — and a sharded load into a model that has
    them fails with a size mismatch. Every ``state_dict`` of the module (save_state, DCP, get_state_dict, the
    user's own) keeps the FP8 state this package created at prepare."""
    if not getattr(module, "_accel_fp8_fix_keeps_fp8_state", False):
        module.register_state_dict_pre_hook(_checkpoint_fp8_state)
        module._accel_fp8_fix_keeps_fp8_state = True


def save_state(wrapped, instance, args, kwargs):
    """``Accelerator.save_state``: the pending (row 0) amax is MAX-reduced on the amax group first; a sharded
    save of a TP-packed parameter is refused up front, naming it (A16)."""
    models = prepared_models(instance)
    _refuse_strided_sharded_save(instance, models)
    _reduce_pending(instance, models)
    return wrapped(*args, **kwargs)


def get_state_dict(wrapped, instance, args, kwargs):
    """``Accelerator.get_state_dict(model)``: same, for the model whose state is gathered."""
    model = args[0] if args else kwargs.get("model")
    if model is not None:
        _reduce_pending(instance, [model])
    return wrapped(*args, **kwargs)


def load_state(wrapped, instance, args, kwargs):
    """``Accelerator.load_state``: after loading, every rank holds rank 0's FP8 state (explicit group)."""
    result = wrapped(*args, **kwargs)
    setup = _fp8_setup(instance)
    if setup is not None:
        for model in prepared_models(instance):
            broadcast_fp8_state(model, setup.amax_group, src=setup.amax_group_ranks[0])
    return result
