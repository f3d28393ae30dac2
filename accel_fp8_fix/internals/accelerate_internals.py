"""accelerate internals: the prepared models, one-object preparation, the FP8 recipe kwargs, and its
Transformer Engine forward wrapper.

- ``Accelerator._models`` / ``_optimizers`` (every model / optimizer ``prepare`` returned) and
  ``Accelerator._prepare_one`` (the
  per-object step of ``prepare``, used by the re-implemented ``_prepare_tp``);
- ``te_recipe_handler`` (the ``TERecipeKwargs`` accelerate resolved; before 1.16 also the deprecated
  ``fp8_recipe_handler``, which 1.16 removed with ``FP8RecipeKwargs``);
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
    ("utils/transformer_engine.py", f"def {WRAPPER_NAME}("),
)


def replicate_with_tp_accepted() -> bool:
    """Whether the installed accelerate takes ``dp_replicate x tp`` without ``dp_shard`` (accelerate #4193,
    1.16: each replica holds the whole TP model; 1.13-1.15 refuse it at ``ParallelismConfig()``). Read from the
    distribution's metadata, not by importing it."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import Version

    try:
        return Version(version("accelerate")) >= Version("1.16")
    except PackageNotFoundError:
        return False


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
    """The TE recipe kwargs accelerate resolved (``TERecipeKwargs``, or before 1.16 the deprecated
    ``FP8RecipeKwargs``)."""
    return accelerator.te_recipe_handler or getattr(accelerator, "fp8_recipe_handler", None)


def unwrap_accelerate_autocast(func):
    """The function accelerate's TE wrapper wraps, or ``func`` itself when it is not that wrapper."""
    if WRAPPER_NAME in getattr(func, "__qualname__", "") and hasattr(func, "__wrapped__"):
        return func.__wrapped__
    return func
