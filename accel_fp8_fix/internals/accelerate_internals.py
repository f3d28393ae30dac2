"""accelerate internals: the prepared models, one-object preparation, the FP8 recipe kwargs, and its
Transformer Engine forward wrapper.

- ``Accelerator._models`` / ``_optimizers`` (every model / optimizer ``prepare`` returned) and
  ``Accelerator._prepare_one`` (the
  per-object step of ``prepare``, used by the re-implemented ``_prepare_tp``);
- ``te_recipe_handler`` / ``fp8_recipe_handler`` (the ``TERecipeKwargs`` accelerate resolved);
- ``apply_fp8_autowrap`` wraps ``model.forward`` in ``contextual_fp8_autocast`` (TE autocast with no amax
  group); this package replaces that wrapper instead of nesting inside it, recognising it by name and
  unwrapping through ``__wrapped__``.
"""

from __future__ import annotations

WRAPPER_NAME = "contextual_fp8_autocast"
# (module file under accelerate/, text that must be in it): read, not imported
_SOURCES = (
    ("accelerator.py", "self._models = []"),
    ("accelerator.py", "self._optimizers = []"),
    ("accelerator.py", "def _prepare_one(self, obj, first_pass=False"),
    ("accelerator.py", "self.te_recipe_handler = "),
    ("accelerator.py", "self.fp8_recipe_handler = "),
    ("utils/transformer_engine.py", f"def {WRAPPER_NAME}("),
)


def check(versions) -> list[str]:
    from . import check_sources

    return check_sources("accelerate", versions, _SOURCES)


def prepared_models(accelerator) -> list:
    return list(getattr(accelerator, "_models", []))


def prepared_optimizers(accelerator) -> list:
    """accelerate's wrappers (``AcceleratedOptimizer``) of the optimizers ``prepare`` returned, in order."""
    return list(getattr(accelerator, "_optimizers", []))


def prepare_one(accelerator, obj, first_pass: bool = False):
    return accelerator._prepare_one(obj, first_pass=first_pass)


def recipe_handler(accelerator):
    """The TE recipe kwargs accelerate resolved (``TERecipeKwargs`` or the older ``FP8RecipeKwargs``)."""
    return accelerator.te_recipe_handler or accelerator.fp8_recipe_handler


def unwrap_accelerate_autocast(func):
    """The function accelerate's TE wrapper wraps, or ``func`` itself when it is not that wrapper."""
    if WRAPPER_NAME in getattr(func, "__qualname__", "") and hasattr(func, "__wrapped__"):
        return func.__wrapped__
    return func
