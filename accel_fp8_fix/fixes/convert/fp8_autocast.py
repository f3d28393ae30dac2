"""FP8 on (A2) with an explicit amax reduction group (A7): the prepared model's forward runs under TE's
autocast — ``autocast(recipe=, amax_reduction_group=)`` where the installed TE has it (2.9+), else
``fp8_autocast(fp8_recipe=, fp8_group=)`` — with the recipe accelerate would build from
``TERecipeKwargs`` / ``ACCELERATE_FP8_*``, honouring ``use_autocast_during_eval``."""

from __future__ import annotations

from types import MethodType

import torch

from ..._log import warn_user
from ...internals.accelerate_internals import unwrap_accelerate_autocast
from ...internals.transformer_engine import autocast_factory


def te_autocast(te):
    """A function ``(enabled, recipe, group) -> context manager`` for the installed TE's autocast API (the
    version fork lives in internals/transformer_engine/recipes.py)."""
    return autocast_factory(te)


def warn_eval_mode_training(model) -> None:
    """A forward with gradients on while the model is in eval mode runs without FP8 (TE autocast follows
    ``model.training`` unless ``use_autocast_during_eval``): ``from_pretrained`` returns models in eval mode, so a
    script that loads and trains without ``model.train()`` would train in high precision without a word."""
    warn_user(
        f"accel_fp8_fix: {type(model).__name__} is in eval mode (from_pretrained returns models in eval mode) and "
        "this forward tracks gradients: it runs WITHOUT FP8, as TE autocast is off in eval mode. Call model.train() "
        "before training (or set use_autocast_during_eval=True in TERecipeKwargs to run eval in FP8 too)")


def _needs_self(model, target) -> bool:
    """Whether ``target`` must be called with the module first. ``model.forward`` read from the instance, and
    what accelerate's TE wrapper wraps (it calls ``model_forward(*args)``), are called as they are: a bound
    method, or a function set on the instance — ``torch.compile``'s ``OptimizedModule`` sets ``forward`` to the
    compiled ``_orig_mod.__call__``, which takes no module argument (passing one made the inner forward see the
    module as ``input_ids``). Only the class's own ``forward`` function, unbound, takes ``self``."""
    if hasattr(target, "__self__"):
        return False
    return any(target is klass.__dict__.get("forward") for klass in type(model).__mro__)


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
    bound = not _needs_self(model, target)

    def fp8_forward(self, *args, **kwargs):
        enabled = use_during_eval or self.training
        if not enabled and torch.is_grad_enabled():
            warn_eval_mode_training(self)
        with autocast(enabled, recipe, group):
            return target(*args, **kwargs) if bound else target(self, *args, **kwargs)

    fp8_forward.__wrapped__ = target  # accelerate's extract_model_from_parallel unwraps through this
    fp8_forward._accel_fp8_fix_autocast = True
    model.forward = MethodType(fp8_forward, model)
