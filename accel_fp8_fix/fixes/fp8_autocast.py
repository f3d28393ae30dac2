"""FP8 on (A2) with an explicit amax reduction group (A7): the prepared model's forward runs under TE's
autocast — ``autocast(recipe=, amax_reduction_group=)`` where the installed TE has it (2.9+), else
``fp8_autocast(fp8_recipe=, fp8_group=)`` — with the recipe accelerate would build from
``TERecipeKwargs`` / ``ACCELERATE_FP8_*``, honouring ``use_autocast_during_eval``."""

from __future__ import annotations

import inspect
from types import MethodType

import torch

from .._log import warn_user
from ..internals.accelerate_internals import unwrap_accelerate_autocast


def te_autocast(te):
    """A function ``(enabled, recipe, group) -> context manager`` for the installed TE's autocast API."""
    autocast = getattr(te, "autocast", None)
    if autocast is not None and "amax_reduction_group" in inspect.signature(autocast).parameters:
        return lambda enabled, recipe, group: autocast(enabled=enabled, recipe=recipe, amax_reduction_group=group)
    return lambda enabled, recipe, group: te.fp8_autocast(enabled=enabled, fp8_recipe=recipe, fp8_group=group)


def build_recipe(handler):
    """(recipe, use_autocast_during_eval) from accelerate's TE recipe kwargs: what ``apply_fp8_autowrap`` builds
    (DelayedScaling, or MXFP8 with ``use_mxfp8_block_scaling``; its source hash is watched in patches/*.toml),
    plus every other TE recipe by name (fixes/recipes.py), each checked against the installed TE and GPU."""
    from .recipes import build

    return build(handler)


def warn_eval_mode_training(model) -> None:
    """A forward with gradients on while the model is in eval mode runs without FP8 (TE autocast follows
    ``model.training`` unless ``use_autocast_during_eval``): ``from_pretrained`` returns models in eval mode, so a
    script that loads and trains without ``model.train()`` would train in high precision without a word."""
    warn_user(
        f"accel_fp8_fix: {type(model).__name__} is in eval mode (from_pretrained returns models in eval mode) and "
        "this forward tracks gradients: it runs WITHOUT FP8, as TE autocast is off in eval mode. Call model.train() "
        "before training (or set use_autocast_during_eval=True in TERecipeKwargs to run eval in FP8 too)")


def wrap_forward(model, te, recipe, group, use_during_eval: bool) -> None:
    """Run ``model.forward`` under TE autocast. accelerate's own TE wrapper (``contextual_fp8_autocast``,
    which passes no group) is replaced; any other wrapper (fp32 outputs, bf16 autocast) is kept inside."""
    autocast = te_autocast(te)
    target = model.forward
    func = getattr(target, "__func__", target)
    if getattr(func, "_accel_fp8_fix_autocast", False):
        return
    unwrapped = unwrap_accelerate_autocast(func)
    if unwrapped is not func:
        target = unwrapped
    bound = hasattr(target, "__self__")

    def fp8_forward(self, *args, **kwargs):
        enabled = use_during_eval or self.training
        if not enabled and torch.is_grad_enabled():
            warn_eval_mode_training(self)
        with autocast(enabled, recipe, group):
            return target(*args, **kwargs) if bound else target(self, *args, **kwargs)

    fp8_forward.__wrapped__ = target  # accelerate's extract_model_from_parallel unwraps through this
    fp8_forward._accel_fp8_fix_autocast = True
    model.forward = MethodType(fp8_forward, model)
