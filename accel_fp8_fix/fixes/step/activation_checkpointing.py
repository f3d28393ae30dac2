"""Activation checkpointing under FP8 (failure A14 in docs/failures.md).

``torch.utils.checkpoint`` recomputes a layer in backward, outside the forward's TE autocast: TE then
recomputes without FP8 and the recomputed saved tensors no longer match the forward's. Both ways users
turn checkpointing on go through one attribute holding ``torch.utils.checkpoint.checkpoint``:

- transformers' ``gradient_checkpointing_enable()`` / ``activation_checkpointing_enable()``: every
  ``GradientCheckpointingLayer`` has ``_gradient_checkpointing_func``;
- accelerate's FSDP2 ``activation_checkpointing``: torch's ``CheckpointWrapper`` has ``checkpoint_fn``.

:func:`route_checkpointing_through_te` points them at Transformer Engine's FP8-aware
``transformer_engine.pytorch.distributed.checkpoint``, which recomputes under the forward's FP8
recipe with the forward's scales, keeping the caller's options (``use_reentrant``, ``context_fn``...);
the recompute's amaxes are reduced under the forward's autocast key, so on the mesh's group.
``use_reentrant=False`` (transformers' default) is the cheap one: TE's reentrant recompute issues many
more amax all-reduces (measured: 17 per step against 4 for a 2-layer Llama; 2 without checkpointing).
A custom checkpoint function (not torch's) is left alone and reported.
"""

from __future__ import annotations

import functools

import torch.utils.checkpoint

_TORCH_ONLY_KWARGS = ("preserve_rng_state",)  # TE always restores the RNG states of the forward


def _te_checkpoint(function, *args, use_reentrant=True, **kwargs):
    from ...internals.transformer_engine import fp8_checkpoint

    for key in _TORCH_ONLY_KWARGS:
        kwargs.pop(key, None)
    return fp8_checkpoint(function, *args, use_reentrant=use_reentrant, **kwargs)


def _torch_checkpoint_keywords(fn):
    """The keywords of ``partial(torch.utils.checkpoint.checkpoint, ...)`` (or {} for the bare function);
    None for anything else."""
    if fn is torch.utils.checkpoint.checkpoint:
        return {}
    if isinstance(fn, functools.partial) and fn.func is torch.utils.checkpoint.checkpoint and not fn.args:
        return dict(fn.keywords)
    return None


def route_checkpointing_through_te(model) -> tuple[list, list]:
    """Make every checkpointed layer of ``model`` recompute with TE's FP8-aware checkpoint.

    Returns (routed module names, module names left alone because their checkpoint function is custom).
    """
    from ...internals.torch_internals import checkpoint_wrapper_type

    CheckpointWrapper = checkpoint_wrapper_type()
    routed, custom = [], []
    for name, module in model.named_modules():
        if isinstance(module, CheckpointWrapper):
            attr = "checkpoint_fn"
        elif "_gradient_checkpointing_func" in vars(module) and getattr(module, "gradient_checkpointing", False):
            attr = "_gradient_checkpointing_func"
        else:
            continue
        fn = getattr(module, attr)
        if getattr(fn, "func", None) is _te_checkpoint:
            continue
        keywords = _torch_checkpoint_keywords(fn)
        if keywords is None:
            custom.append(name)
            continue
        keywords.setdefault("use_reentrant", True)  # torch's default when not passed (it warns), explicit for TE
        setattr(module, attr, functools.partial(_te_checkpoint, **keywords))
        routed.append(name)
    return routed, custom
