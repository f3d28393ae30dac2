"""The ``settings`` fix (patch ``Accelerator.__init__``): every setting this package reads, the layout and the TE
recipe accelerate resolved are checked at ``Accelerator()`` — before any model is loaded, sharded or prepared."""

from __future__ import annotations

from .. import settings
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
    result = wrapped(*args, **kwargs)
    if getattr(instance, "fp8_enabled", False):
        from ..internals.accelerate_internals import recipe_handler

        handler = recipe_handler(instance)
        if handler is not None and str(getattr(handler, "backend", "TE")).upper() == "TE":
            check_handler(handler)
    return result
