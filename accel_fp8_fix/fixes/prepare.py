"""``Accelerator.prepare`` for TE FP8 with FSDP2 and/or TP: convert *after* sharding, then turn FP8 on.

Stock order (1.13-1.16): ``_prepare_tp`` -> ``_prepare_cp`` -> ``_prepare_te`` (convert full-size modules,
A1) -> ``_prepare_fsdp2`` (no FP8 autocast, A2). Patched: the TP layout is recorded, ``_prepare_te``
only validates, stock sharding runs, and then :func:`finish_fp8_prepare` converts on the sharded
parameters, creates and registers the FP8 state, makes it identical on every rank, and wraps the
forward in TE autocast with the mesh's amax reduction group.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from .._log import say, warn_user
from ..distributed.agreement import check_patch_set_agreement
from ..distributed.collectives import group_of
from ..distributed.dtensor import is_dtensor
from ..distributed.mesh_facts import amax_group_dims
from ..engine.engine import calling_patch_set
from ..internals import transformers_features
from ..internals.transformer_engine import FP8_STATE_ATTRS, gemms_per_forward, init_fp8_metadata
from .step.activation_checkpointing import route_checkpointing_through_te
from .checkpoint.checkpoint import keep_fp8_state_in_checkpoints
from .all_gather import fp8_all_gather
from .convert.fp8_autocast import te_autocast, wrap_forward
from .convert.fp8_plan import Fp8Plan, plan_fp8
from .convert.fp8_state import amax_group_of, broadcast_fp8_state, register_tensor_state
from .convert.fp8_shapes import weight_multiple
from .checkpoint.fp8_state_loading import install_safe_loading
from .convert import run_state
from .convert.presharded import check_mesh_matches
from .convert.te_convert import ConversionReport, convert_after_sharding
from .convert.tp_layout import record_tp_layout
from .convert.transformers_check import check_model as check_transformers_internals

logger = logging.getLogger(__name__)



@dataclass
class Fp8Setup:
    """What the patched prepare did; kept on the accelerator as ``accelerator.accel_fp8_fix``."""

    conversion: ConversionReport
    recipe: object = None
    amax_group_ranks: tuple = ()
    amax_group: object = None
    mesh: object = None
    registered_state: list = field(default_factory=list)
    fp8_enabled: bool = False
    checkpointing_routed: list = field(default_factory=list)  # layers recomputing with TE's FP8-aware checkpoint
    model: object = field(default=None, repr=False, compare=False)  # the prepared model this setup is for
    all_gather: object = None  # fixes/all_gather/fp8_all_gather.Fp8AllGatherSetup when weights are all-gathered in FP8


def handles_fp8_prepare(accelerator) -> bool:
    """Does the patched prepare apply to this accelerator (TE FP8 with FSDP2 or TP)?"""
    from accelerate.utils.dataclasses import FP8BackendType

    if accelerator.fp8_backend != FP8BackendType.TE:
        return False
    pc = getattr(accelerator, "parallelism_config", None)
    return bool(accelerator.is_fsdp2 or (pc is not None and pc.tp_enabled))


def _the_model(objects):
    models = [o for o in objects if isinstance(o, torch.nn.Module)]
    return models[0] if len(models) == 1 else None


def with_pending_model(instance, args: tuple):
    """For ``prepare(*args)``: ``(args, model)`` with the model ``prepare_model`` kept aside put first when ``args``
    hold an optimizer and no model (else ``model`` is None and ``args`` unchanged)."""
    kept = run_state.record(instance)
    model = kept.pending_model
    if model is None or any(isinstance(a, torch.nn.Module) for a in args):
        return args, None
    if not any(isinstance(a, torch.optim.Optimizer) for a in args):
        return args, None
    kept.pending_model = None
    return (model, *args), model


def drop_pending_model(result, model):
    """The result of ``prepare(model, *args)`` as ``prepare(*args)`` returns it. The model is prepared in place
    (the caller holds it from ``prepare_model``): another object back would leave that caller training a stale one."""
    items = list(result) if isinstance(result, (tuple, list)) else [result]
    if items[0] is not model:
        raise RuntimeError(
            f"accel_fp8_fix: prepare returned another object for {type(model).__name__} (a model sharded at load, "
            "prepared without its optimizer): pass the model and its optimizer to accelerator.prepare together")
    rest = items[1:]
    return rest[0] if len(rest) == 1 else tuple(rest)


def prepare(wrapped, instance, args, kwargs):
    """Errors leaving it get a note, and the prepared model its audit setup, from the hooks the TOML declares
    (``notes``, ``on_return``: diagnostics/notes.py)."""
    kept = run_state.record(instance)
    if not kept.agreed:
        check_patch_set_agreement(calling_patch_set())
        kept.agreed = True
    if not handles_fp8_prepare(instance):
        return wrapped(*args, **kwargs)
    args, pending = with_pending_model(instance, args)  # a model Trainer prepared alone (A22)
    model = _the_model(args)
    # the recipe and the FP8 all-gather decided once (fixes/convert/fp8_plan.py); an FP8 all-gather asked for where it
    # cannot run is refused there, by name, before anything is sharded or converted
    plan = plan_fp8(instance)
    if model is not None:
        check_mesh_matches(instance, model)  # a model transformers sharded at load (A18) must match the config
        check_transformers_internals(model)  # what it uses of transformers' internals: a tested release's source
        record_tp_layout(model)
    with run_state.preparing(instance):
        result = wrapped(*args, **kwargs)
    prepared = _the_model(result if isinstance(result, (tuple, list)) else (result,))
    if prepared is not None:
        instance.accel_fp8_fix = finish_fp8_prepare(instance, prepared, plan)
        instance.accel_fp8_fix.model = prepared
    return result if pending is None else drop_pending_model(result, pending)


def prepare_te(wrapped, instance, args, kwargs):
    """``Accelerator._prepare_te``: while a patched prepare runs, validate like stock but do not convert."""
    if not run_state.inside_prepare(instance):
        return wrapped(*args, **kwargs)
    models = [o for o in args if isinstance(o, torch.nn.Module)]
    optimizers = [o for o in args if isinstance(o, torch.optim.Optimizer)]
    if (models or optimizers) and not (models and optimizers):
        raise ValueError(
            "You must pass a model and an optimizer together to `accelerate.prepare()` when using TransformerEngine."
        )
    if len(models) > 1 or len(optimizers) > 1:
        raise ValueError(
            f"You can't use multiple models ({len(models)}) or optimizers {len(optimizers)} with TransformerEngine."
        )
    return list(args)


def mesh_of(accelerator, model):
    """The device mesh: accelerate's (ParallelismConfig), else the one of a sharded parameter."""
    mesh = getattr(accelerator, "torch_device_mesh", None)
    if mesh is not None:
        return mesh
    for param in model.parameters():
        if is_dtensor(param):
            return param.device_mesh
    return None


def amax_group_for(mesh):
    """The amax reduction group: every rank of the mesh (dp x cp x tp flattened), never an implicit WORLD."""
    if mesh is None:
        return None, ()
    import torch.distributed as dist

    group = group_of(mesh, amax_group_dims(mesh))
    return group, tuple(dist.get_process_group_ranks(group))


def finish_fp8_prepare(accelerator, model, plan: Fp8Plan) -> Fp8Setup:
    import transformer_engine.pytorch as te

    recipe, use_during_eval = plan.built
    conversion = convert_after_sharding(model, te, dim_multiple=weight_multiple(recipe))
    mesh = mesh_of(accelerator, model)
    group, ranks = amax_group_for(mesh)
    setup = Fp8Setup(conversion=conversion, amax_group=group, amax_group_ranks=ranks, mesh=mesh)
    if not conversion.te_modules:
        message = (
            "accel_fp8_fix: no layer of the model could be converted to Transformer Engine "
            f"({len(conversion.skipped)} skipped); FP8 stays OFF and the model trains in high precision"
        )
        warn_user(message)  # FP8 was asked for and is off: the user must know, at their prepare() line
        return setup
    setup.recipe = recipe
    # FP8 state now, on the module's device (as the first FP8 forward would create it), then registered; TE keeps
    # the group a module's amaxes are reduced over from here (expert-parallel experts: their own, moe_experts.py).
    with torch.no_grad():
        for module in conversion.te_modules:
            with te_autocast(te)(True, recipe, amax_group_of(module, group)):
                init_fp8_metadata(module, gemms_per_forward(module))
    if plan.all_gather:
        setup.all_gather = fp8_all_gather.install(model, conversion.te_modules, recipe, group)
    setup.registered_state = register_tensor_state(model, conversion.te_modules, attrs=FP8_STATE_ATTRS)
    for module in conversion.te_modules:
        install_safe_loading(module)
        keep_fp8_state_in_checkpoints(module)  # also after an eval pass, where TE would save none (A19)
    if group is not None:
        broadcast_fp8_state(model, group, src=ranks[0])
    wrap_forward(model, te, recipe, group, use_during_eval)
    setup.checkpointing_routed, custom = route_checkpointing_through_te(model)
    if custom:
        say(logger, logging.WARNING,
            f"accel_fp8_fix: {len(custom)} layer(s) use a custom activation-checkpoint function, left as is; its "
            f"recompute must run under TE's FP8 autocast: {', '.join(custom)}")
    setup.fp8_enabled = True
    say(logger, logging.INFO,
        f"accel_fp8_fix: {len(conversion.converted)} module(s) converted to Transformer Engine after sharding, "
        f"{len(conversion.experts)} MoE experts module(s) on TE grouped GEMMs, {len(conversion.skipped)} kept; "
        f"amax group {list(ranks)}; {transformers_features.describe()}")
    return setup

