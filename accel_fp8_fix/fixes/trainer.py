"""transformers' ``Trainer`` on a model transformers sharded at load (A22).

A model loaded N-D with ``from_pretrained(..., distributed_config=DistributedConfig(tp_size, fsdp_size))`` (the
only FSDP2 x TP loading of transformers 5.x) is marked ``is_distributed_loading_by_transformers``, and
``Trainer`` (5.24) prepares it apart from its optimizer::

    model = accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)
    optimizer = accelerator.prepare(optimizer)

Stock, under an FSDP2 accelerate config, the second call raises ``ValueError: When using FSDP2, a model and
optimizer must be passed together to `Accelerator.prepare()` ...``; without FSDP2 (TP only) it passes and the
model is never converted to Transformer Engine: FP8 silently off. Here ``prepare_model`` keeps such a model
aside (untouched: the Trainer already built the optimizer on its parameters) and the next ``prepare`` of an
optimizer alone prepares both together, the path of a script's ``prepare(model, optimizer)`` (TE conversion on
the shards, FP8 state, amax group, optimizer pointed at any new Parameter), returning what was asked for.
"""

from __future__ import annotations

import logging

import torch

from .._log import say
from ..distributed.dtensor import is_dtensor

logger = logging.getLogger(__name__)

PENDING = "_accel_fp8_fix_pending_model"


def _bind(model=None, device_placement=None, evaluation_mode=False):
    return model, evaluation_mode


def _deferred(instance, model) -> bool:
    """A model sharded at load, passed to ``prepare_model`` alone by an accelerator whose prepare this package
    patches (TE FP8 with FSDP2 or TP), and not already prepared."""
    from .prepare import DEFER_FLAG, _handles

    return (isinstance(model, torch.nn.Module)
            and not getattr(instance, DEFER_FLAG, False)  # not the inner call of a (patched) prepare
            and not getattr(model, "_is_accelerate_prepared", False)
            and getattr(model, "is_distributed_loading_by_transformers", False)
            and any(is_dtensor(p) for p in model.parameters())
            and _handles(instance))


def prepare_model(wrapped, instance, args, kwargs):
    """``Accelerator.prepare_model``: a model sharded at load, prepared alone with ``evaluation_mode=True`` (what
    ``Trainer`` does), is kept for the next ``prepare(optimizer)``; every other call is stock."""
    model, evaluation_mode = _bind(*args, **kwargs)
    if not (evaluation_mode and _deferred(instance, model)):
        return wrapped(*args, **kwargs)
    setattr(instance, PENDING, model)
    say(logger, logging.INFO,
        f"accel_fp8_fix: {type(model).__name__} was sharded at load (DistributedConfig) and is prepared without its "
        "optimizer (transformers' Trainer): Transformer Engine conversion and FP8 wait for the optimizer's prepare")
    return model


def with_pending_model(instance, args: tuple):
    """For ``prepare(*args)``: ``(args, model)`` with the model ``prepare_model`` kept aside put first when ``args``
    hold an optimizer and no model (else ``model`` is None and ``args`` unchanged)."""
    model = getattr(instance, PENDING, None)
    if model is None or any(isinstance(a, torch.nn.Module) for a in args):
        return args, None
    if not any(isinstance(a, torch.optim.Optimizer) for a in args):
        return args, None
    setattr(instance, PENDING, None)
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
