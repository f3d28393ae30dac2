"""The ``settings`` fix (patch ``Accelerator.__init__``): every setting this package reads, the layout and the TE
recipe accelerate resolved are checked at ``Accelerator()`` — before any model is loaded, sharded or prepared."""

from __future__ import annotations

from ... import settings
from .layout import check_accelerator_kwargs
from .recipes import check_handler


def accelerator_init(wrapped, instance, args, kwargs):
    """``Accelerator.__init__``: every setting this package reads is checked before accelerate starts (a bad value
    raises ValueError naming it), and, once accelerate has resolved its FP8 configuration, the TE recipe and its
    settings (an unknown recipe, a setting the recipe does not take) — before any model is prepared; the script
    fails at ``Accelerator()``, not after loading and sharding."""
    problems = settings.check(owners=("package",))
    if problems:
        raise ValueError("; ".join(str(exc) for _setting, exc in problems))
    check_accelerator_kwargs(kwargs)  # a layout accelerate refuses: named, with the one to use instead
    auto_backend = _backend_left_to_accelerate(kwargs)
    result = wrapped(*args, **kwargs)
    if auto_backend:
        _say_torchao_chosen(instance)
    if getattr(instance, "fp8_enabled", False):
        from ...internals.accelerate_internals import recipe_handler

        handler = recipe_handler(instance)
        if handler is not None and str(getattr(handler, "backend", "TE")).upper() == "TE":
            check_handler(handler)
    return result


def _backend_left_to_accelerate(kwargs) -> bool:
    """No FP8 backend chosen: no recipe handler among ``kwargs_handlers`` and accelerate's ``ACCELERATE_FP8_BACKEND``
    (what ``fp8_config: {backend: ...}`` sets under ``accelerate launch``) unset, read as accelerate reads it."""
    handlers = kwargs.get("kwargs_handlers") or ()
    if any(type(h).__name__ in ("TERecipeKwargs", "AORecipeKwargs", "FP8RecipeKwargs") for h in handlers):
        return False
    from accelerate.utils.environment import parse_choice_from_env  # accelerate's own reader of its variable

    return parse_choice_from_env("ACCELERATE_FP8_BACKEND", "NO") == "NO"


def _say_torchao_chosen(accelerator) -> None:
    """accelerate prefers torchao when both FP8 backends are installed and none is chosen: this package (TE FP8) then
    stands down (fixes/prepare.py: handles_fp8_prepare). Said once, naming the setting — the backend is the user's
    choice, never changed here."""
    import importlib.util

    if not getattr(accelerator, "fp8_enabled", False) or getattr(accelerator, "ao_recipe_handler", None) is None:
        return
    if importlib.util.find_spec("transformer_engine") is None:
        return
    from ..._log import warn_user

    warn_user("accel_fp8_fix: FP8 with no backend chosen and both torchao and Transformer Engine installed: accelerate "
              "picked torchao, so this package (Transformer Engine FP8 on FSDP2 / TP) stands down and accelerate's "
              "torchao path runs unchanged. For Transformer Engine set `fp8_config: {backend: TE}` in the accelerate "
              "config (ACCELERATE_FP8_BACKEND=TE), or pass kwargs_handlers=[TERecipeKwargs()]")
