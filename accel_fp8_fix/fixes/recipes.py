"""Every Transformer Engine recipe, from accelerate's config or ``TERecipeKwargs``, validated before use.

Stock accelerate builds ``DelayedScaling`` or, with ``use_mxfp8_block_scaling``, ``MXFP8BlockScaling``;
TE also has per-tensor current scaling (``Float8CurrentScaling``), ``Float8BlockScaling`` and NVFP4
(``NVFP4BlockScaling``). Choose one by name:

* accelerate config file: ``fp8_config: {backend: TE, recipe: current}`` (``accelerate launch`` exports it
  as ``ACCELERATE_FP8_RECIPE``; the environment variable works on its own too);
* Python: ``accel_fp8_fix.te_recipe_kwargs(recipe="current", fp8_format="HYBRID")`` returns accelerate's own
  ``TERecipeKwargs`` carrying the choice (``recipe=`` may also be a TE recipe object).

Names: ``delayed``, ``current``, ``mxfp8``, ``block``, ``nvfp4``. The recipe is checked against the
installed TE (does it have the class?) and the GPU (TE's own ``check_*_support``): a recipe that cannot
run raises a ``ValueError`` naming the recipe, the TE version, the device and TE's reason — at
``prepare``, not at the first GEMM.
"""

from __future__ import annotations

import os
import sys

ENV = "ACCELERATE_FP8_RECIPE"
# te_recipe_kwargs() choices by handler (accelerate's to_kwargs() reads every instance attribute, so the
# choice cannot live on the handler itself): id -> (handler, recipe name or object, extra recipe options)
_CHOICES: dict = {}

# name: (TE recipe class, TE support check, TERecipeKwargs fields the class takes)
RECIPES = {
    "delayed": ("DelayedScaling", "check_fp8_support", None),  # None: every field (stock behaviour)
    "current": ("Float8CurrentScaling", "check_fp8_support", ("fp8_format",)),
    "mxfp8": ("MXFP8BlockScaling", "check_mxfp8_support", ("fp8_format", "margin")),
    "block": ("Float8BlockScaling", "check_fp8_block_scaling_support", ("fp8_format",)),
    "nvfp4": ("NVFP4BlockScaling", "check_nvfp4_support", ()),
}
ALIASES = {
    "delayed_scaling": "delayed", "delayedscaling": "delayed",
    "current_scaling": "current", "float8_current_scaling": "current", "float8currentscaling": "current",
    "mxfp8_block_scaling": "mxfp8", "mxfp8blockscaling": "mxfp8",
    "float8_block_scaling": "block", "fp8_block_scaling": "block", "float8blockscaling": "block",
    "nvfp4_block_scaling": "nvfp4", "nvfp4blockscaling": "nvfp4",
}
# TERecipeKwargs fields, and the ones only DelayedScaling reads (set explicitly for another recipe: an error)
DELAYED_ONLY = ("amax_history_len", "amax_compute_algo", "interval")


def recipe_name(value: str, setting: str) -> str:
    key = str(value).strip().lower().replace("-", "_")
    key = ALIASES.get(key, key)
    if key not in RECIPES:
        raise ValueError(f"accel_fp8_fix: {setting}={value!r} is not a Transformer Engine recipe this package knows; "
                         f"use one of {', '.join(RECIPES)}")
    return key


def te_recipe_kwargs(recipe="delayed", **fields):
    """accelerate's ``TERecipeKwargs(**fields)`` that asks for ``recipe`` (a name or a TE recipe object).

    Fields ``TERecipeKwargs`` does not have are passed to the TE recipe class (e.g. ``fp4_format``)."""
    import dataclasses

    from accelerate.utils import TERecipeKwargs

    known = {f.name for f in dataclasses.fields(TERecipeKwargs)}
    handler = TERecipeKwargs(**{k: v for k, v in fields.items() if k in known})
    if isinstance(recipe, str):
        recipe = recipe_name(recipe, "te_recipe_kwargs(recipe)")
    _CHOICES[id(handler)] = (handler, recipe, {k: v for k, v in fields.items() if k not in known})
    return handler


def _choice_of(handler) -> tuple:
    entry = _CHOICES.get(id(handler)) if handler is not None else None
    return entry[1:] if entry is not None and entry[0] is handler else (None, {})


def _te_version() -> str:
    from ..engine.versions import installed_version

    return installed_version("transformer-engine") or installed_version("transformer_engine") or "?"


def _device() -> str:
    """The GPU as TE sees it (TE's own capability query; the CPU rehearsal answers for TE's frames only)."""
    try:
        from transformer_engine.pytorch.utils import get_device_compute_capability

        major, minor = get_device_compute_capability()
        rehearsal = sys.modules.get("accel_fp8_fix.rehearsal.te_on_cpu")
        where = " (the CPU rehearsal's answer)" if rehearsal is not None and rehearsal.is_installed() else ""
        return f"a GPU of compute capability {major}.{minor} (sm{major}{minor}){where}"
    except Exception as exc:  # noqa: BLE001 - no CUDA device at all
        return f"no usable GPU ({type(exc).__name__}: {exc})"


def _support_check(check_name: str):
    try:
        from transformer_engine.pytorch import quantization as q
    except ImportError:  # TE < 2.9
        from transformer_engine.pytorch import fp8 as q
    return getattr(q, check_name, None)


def _chosen(handler) -> tuple[object, str]:
    """(name or recipe object, the setting it came from)."""
    from_handler = _choice_of(handler)[0]
    if from_handler is not None:
        return from_handler, "te_recipe_kwargs(recipe)"
    if os.environ.get(ENV):
        setting = f"fp8_config `recipe` / {ENV}"
        return recipe_name(os.environ[ENV], setting), setting
    return None, ""


def build(handler):
    """(TE recipe, use_autocast_during_eval) for accelerate's ``TERecipeKwargs`` (or None), validated."""
    import transformer_engine.common.recipe as te_recipe

    kwargs = handler.to_kwargs() if handler is not None else {}
    kwargs.pop("backend", None)
    use_during_eval = kwargs.pop("use_autocast_during_eval", False)
    mxfp8_flag = kwargs.pop("use_mxfp8_block_scaling", False)
    choice, setting = _chosen(handler)
    if choice is None:
        choice, setting = ("mxfp8", "use_mxfp8_block_scaling") if mxfp8_flag else ("delayed", "the default")
    elif mxfp8_flag and choice != "mxfp8":
        raise ValueError(f"accel_fp8_fix: use_mxfp8_block_scaling asks for MXFP8 but {setting} asks for {choice!r}: "
                         "choose one")
    if not isinstance(choice, str):  # a TE recipe object
        _check_support(type(choice).__name__, _check_for(choice), setting)
        return choice, use_during_eval
    class_name, check_name, takes = RECIPES[choice]
    cls = getattr(te_recipe, class_name, None)
    if cls is None:
        raise ValueError(f"accel_fp8_fix: {setting} asks for the {choice!r} recipe ({class_name}), which Transformer "
                         f"Engine {_te_version()} does not have: upgrade Transformer Engine or choose another recipe")
    if "fp8_format" in kwargs:
        kwargs["fp8_format"] = getattr(te_recipe.Format, kwargs["fp8_format"])
    if takes is not None:
        unused = sorted(k for k in kwargs if k not in takes)
        if unused:
            raise ValueError(f"accel_fp8_fix: {', '.join(unused)} set for the {choice!r} recipe ({class_name}), "
                             f"which does not take {'it' if len(unused) == 1 else 'them'} (the amax history settings are "
                             "DelayedScaling's); remove the setting or choose the 'delayed' recipe")
    kwargs.update(_choice_of(handler)[1])
    _check_support(class_name, check_name, setting)
    try:
        recipe = cls(**kwargs)
    except (TypeError, ValueError, AssertionError) as exc:
        raise ValueError(f"accel_fp8_fix: Transformer Engine {_te_version()} refused {class_name}"
                         f"({', '.join(f'{k}={v!r}' for k, v in kwargs.items())}) from {setting}: {exc}") from exc
    return recipe, use_during_eval


def _check_for(recipe) -> str:
    for class_name, check_name, _ in RECIPES.values():
        if type(recipe).__name__ == class_name:
            return check_name
    return "check_fp8_support"


def _check_support(class_name: str, check_name: str, setting: str) -> None:
    check = _support_check(check_name)
    if check is None:
        return  # an older TE without this check: TE decides at the first GEMM
    available, reason = check()
    if not available:
        raise ValueError(f"accel_fp8_fix: the {class_name} recipe ({setting}) cannot run on {_device()} with "
                         f"Transformer Engine {_te_version()}: {reason}")
