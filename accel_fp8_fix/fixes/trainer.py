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
the shards, FP8 state, amax group, optimizer pointed at any new Parameter), returning what was asked for
(fixes/prepare.py: ``with_pending_model`` / ``drop_pending_model``).
"""

from __future__ import annotations

import logging

import torch

from .._log import say
from ..distributed.dtensor import is_dtensor
from ..internals import transformers_features
from .convert import run_state
from .prepare import handles_fp8_prepare

logger = logging.getLogger(__name__)


def _bind(model=None, device_placement=None, evaluation_mode=False):
    return model, evaluation_mode


def _deferred(instance, model) -> bool:
    """A model sharded at load, passed to ``prepare_model`` alone by an accelerator whose prepare this package
    patches (TE FP8 with FSDP2 or TP), and not already prepared."""
    return (isinstance(model, torch.nn.Module)
            and not run_state.inside_prepare(instance)  # not the inner call of a (patched) prepare
            and not getattr(model, "_is_accelerate_prepared", False)
            and getattr(model, "is_distributed_loading_by_transformers", False)
            and any(is_dtensor(p) for p in model.parameters())
            and handles_fp8_prepare(instance))


def prepare_model(wrapped, instance, args, kwargs):
    """``Accelerator.prepare_model``: a model sharded at load, prepared alone with ``evaluation_mode=True`` (what
    ``Trainer`` does), is kept for the next ``prepare(optimizer)``; every other call is stock."""
    model, evaluation_mode = _bind(*args, **kwargs)
    if not (evaluation_mode and _deferred(instance, model)):
        return wrapped(*args, **kwargs)
    transformers_features.require("trainer_handoff", [type(model).__name__])  # the hand-off this waits for
    run_state.record(instance).pending_model = model
    say(logger, logging.INFO,
        f"accel_fp8_fix: {type(model).__name__} was sharded at load (DistributedConfig) and is prepared without its "
        "optimizer (transformers' Trainer): Transformer Engine conversion and FP8 wait for the optimizer's prepare")
    return model
