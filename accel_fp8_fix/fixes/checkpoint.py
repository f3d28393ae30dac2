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


def save_state(wrapped, instance, args, kwargs):
    """``Accelerator.save_state``: the pending (row 0) amax is MAX-reduced on the amax group first."""
    _reduce_pending(instance, prepared_models(instance))
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
