"""FP8 state through checkpoints (A7, A13 in docs/failures.md): identical on every rank before a save
(whichever rank's copy the writer keeps) and after a load (broadcast from the mesh's first rank); TP-packed
parameters through sharded checkpoints (A16, ``packed_checkpoint``)."""

from __future__ import annotations

import contextlib
import functools
import os

import torch

from ...distributed import collectives
from ...internals.accelerate_internals import prepared_models
from ...internals.transformer_engine import keep_fp8_checkpoint
from . import checkpoint_complete, ep_checkpoint, packed_checkpoint, tp_checkpoint
from ..convert.fp8_state import broadcast_fp8_state, reduce_pending_amax


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


def _checkpoint_fp8_state(module, prefix=None, keep_vars=None) -> None:
    keep_fp8_checkpoint(module)


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
    """``Accelerator.save_state``: the pending (row 0) amax is MAX-reduced on the amax group first; a TP-packed
    parameter (and its optimizer state) reaches DCP as one chunk per row range a rank holds (A16). Once every
    process has written its part, the folder is marked complete (A25)."""
    models = prepared_models(instance)
    _reduce_pending(instance, models)
    with tp_checkpoint.sharded_checkpoint(instance), packed_checkpoint.described_packed_parameters(instance), \
            ep_checkpoint.expert_parallel_fp8_state(instance):
        location = wrapped(*args, **kwargs)  # TP without FSDP: models / optimizers through DCP (A21)
    if _fp8_setup(instance) is not None and location is not None:
        _every_process(instance, True, "save_state complete")  # each has written its files
        if instance.is_main_process:
            checkpoint_complete.write_marker(str(location), instance.num_processes)
    return location


def _every_process(accelerator, value, name: str) -> list:
    import torch.distributed as dist

    if accelerator.num_processes == 1 or not dist.is_initialized():
        return [value]
    return collectives.all_gather_object(value, group=dist.group.WORLD, name=name)


def _refuse_incomplete(accelerator, input_dir) -> None:
    """A25: a folder a ``save_state`` did not finish is refused by name before anything is read, decided by all
    processes together (one that refused alone would leave the others waiting in the load's first collective)."""
    if _fp8_setup(accelerator) is None:
        return
    folder = checkpoint_complete.load_dir(accelerator, input_dir)
    if folder is None or not os.path.isdir(folder):
        return  # accelerate's own error
    found = _every_process(accelerator, checkpoint_complete.missing_parts(folder, accelerator.num_processes),
                           "load_state completeness")
    missing = sorted({part for parts in found for part in parts})
    checkpoint_complete.refuse(folder, missing, accelerator.num_processes)


def get_state_dict(wrapped, instance, args, kwargs):
    """``Accelerator.get_state_dict(model, unwrap=True)``: the pending amax reduced first, as for save_state.
    With ``unwrap=True`` (the default, and what ``save_model`` uses: an export) the FP8 state of the Transformer
    Engine modules this package's prepare created (their ``_extra_state``) is left out — it belongs to
    ``save_state`` (which gathers with ``unwrap=False``, or through DCP), and plain transformers loads the export
    with no unexpected key."""
    model = args[0] if args else kwargs.get("model")
    unwrap = args[1] if len(args) > 1 else kwargs.get("unwrap", True)
    if model is not None:
        _reduce_pending(instance, [model])
    state = wrapped(*args, **kwargs)
    if unwrap and state and model is not None:
        for key in _fp8_state_keys(instance, model):
            state.pop(key, None)
    return state


EXTRA_STATE = "_extra_state"
_WRAPPER_PARTS = ("_checkpoint_wrapped_module", "_orig_mod")  # prefixes state_dict hides (checkpoint, compile)


def _fp8_state_keys(accelerator, model) -> list[str]:
    """State-dict keys of the ``_extra_state`` of the TE modules this package's prepare created or set up in
    ``model`` (every converted Linear / LayerNorm, every TE module with FP8 state); none when it did not prepare
    ``model``."""
    return [key for key, _ in _fp8_state_modules(accelerator, model)]


def _fp8_state_modules(accelerator, model) -> list:
    """[(state-dict key of its ``_extra_state``, module)] of those TE modules."""
    setup = getattr(accelerator, "accel_fp8_fix", None)
    conversion = getattr(setup, "conversion", None)
    if conversion is None or getattr(setup, "model", None) is not model:
        return []
    ours = {id(m) for m in conversion.te_modules}
    converted = set(conversion.converted)
    found = []
    for name, module in model.named_modules():
        if id(module) in ours or name in converted:
            parts = [p for p in name.split(".") if p not in _WRAPPER_PARTS]
            found.append((".".join([*parts, EXTRA_STATE]), module))
    return found


@contextlib.contextmanager
def extra_state_sized_as(accelerator, input_dir):
    """While a sharded checkpoint loads: each TE module this package prepared hands DCP an ``_extra_state`` buffer of
    the checkpoint's byte count, not of its own current pickle's. TE's ``_extra_state`` is a pickle whose length
    varies with what the process ran (a recompute under activation checkpointing adds an entry to ``fp8_meta``:
    2201 -> 2241 bytes), so a run resumed in a fresh process would otherwise meet a size mismatch for state that is
    the same; TE's ``set_extra_state`` then unpickles the bytes DCP read into it."""
    sizes = tp_checkpoint.extra_state_sizes(os.path.expanduser(str(input_dir))) if input_dir else {}
    swapped = []
    for model in prepared_models(accelerator) if sizes else ():
        for key, module in _fp8_state_modules(accelerator, model):
            if sizes.get(key):
                module.get_extra_state = functools.partial(torch.empty, sizes[key], dtype=torch.uint8)
                swapped.append(module)
    try:
        yield
    finally:
        for module in swapped:
            del module.get_extra_state


def load_state(wrapped, instance, args, kwargs):
    """``Accelerator.load_state``: after loading, every rank holds rank 0's FP8 state (explicit group). A checkpoint
    a ``save_state`` did not finish (A25) and a sharded checkpoint DCP cannot load into the prepared models (A21)
    are refused by name first; TP-packed parameters are read chunk by chunk into their row ranges (A16)."""
    input_dir = args[0] if args else kwargs.get("input_dir")
    _refuse_incomplete(instance, input_dir)
    with ep_checkpoint.expert_parallel_fp8_state(instance):  # the keys the check compares are the ones DCP reads
        tp_checkpoint.check_sharded_load(instance, input_dir)
        with tp_checkpoint.sharded_checkpoint(instance), packed_checkpoint.described_packed_parameters(instance), \
                extra_state_sized_as(instance, input_dir):
            result = wrapped(*args, **kwargs)  # TP without FSDP: models / optimizers through DCP (A21)
    setup = _fp8_setup(instance)
    if setup is not None:
        for model in prepared_models(instance):
            broadcast_fp8_state(model, setup.amax_group, src=setup.amax_group_ranks[0])
    return result
