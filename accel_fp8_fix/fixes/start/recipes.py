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

The recipe name and the settings it takes are checked earlier, by one function (``check_settings``, no torch or
TE import) wherever they are first seen: ``accel-fp8-fix doctor --launch`` (on the variables ``accelerate
launch`` would export, ``settings_from_env``), ``Accelerator()`` (fixes/start/accelerator_init.py, patch ``settings``) and
``te_recipe_kwargs`` (fixes/start/recipe_kwargs.py, which also refuses, with ``TypeError``, a field neither
``TERecipeKwargs`` nor the TE recipe class has).
"""

from __future__ import annotations

from ... import settings
from .handler_choices import choice_of

ENV = settings.RECIPE

# name: (TE recipe class, TE support check, TERecipeKwargs fields the class takes); the names, their classes and
# their other spellings are the settings registry's (settings.RECIPE_CLASSES / RECIPE_ALIASES)
_SUPPORT = {
    "delayed": ("check_fp8_support", None),  # None: every field (stock behaviour)
    "current": ("check_fp8_support", ("fp8_format",)),
    "mxfp8": ("check_mxfp8_support", ("fp8_format", "margin")),
    "block": ("check_fp8_block_scaling_support", ("fp8_format",)),
    "nvfp4": ("check_nvfp4_support", ()),
}
RECIPES = {name: (class_name, *_SUPPORT[name]) for name, class_name in settings.RECIPE_CLASSES.items()}
ALIASES = settings.RECIPE_ALIASES
# TERecipeKwargs fields, and the ones only DelayedScaling reads (set explicitly for another recipe: an error)
DELAYED_ONLY = ("amax_history_len", "amax_compute_algo", "interval")


def recipe_name(value: str, setting: str) -> str:
    key = str(value).strip().lower().replace("-", "_")
    key = ALIASES.get(key, key)
    if key not in RECIPES:
        raise ValueError(f"accel_fp8_fix: {setting}={value!r} is not a Transformer Engine recipe this package knows; "
                         f"use one of {', '.join(RECIPES)}")
    return key


# TERecipeKwargs fields: (the ACCELERATE_FP8_* variable accelerate reads it from, its default). The values are
# normalised as TERecipeKwargs.__post_init__ does, and a field counts as set when it differs from the default,
# as in accelerate's to_kwargs() (what build() receives).
TE_KWARGS = {
    "use_autocast_during_eval": ("USE_AUTOCAST_DURING_EVAL", False),
    "margin": ("MARGIN", 0),
    "interval": ("INTERVAL", 1),
    "fp8_format": ("FORMAT", "HYBRID"),
    "amax_history_len": ("AMAX_HISTORY_LEN", 1024),
    "amax_compute_algo": ("AMAX_COMPUTE_ALGO", "most_recent"),
    "override_linear_precision": (None, (False, False, False)),  # OVERRIDE_FPROP / _DGRAD / _WGRAD
    "use_mxfp8_block_scaling": ("USE_MXFP8_BLOCK_SCALING", False),
}
FP8_FORMATS = ("HYBRID", "E4M3", "E5M2")
AMAX_ALGOS = ("max", "most_recent")
_ACCELERATE_TRUE = ("y", "yes", "t", "true", "on", "1")  # accelerate's str_to_bool (it reads these, not we)
_ACCELERATE_FALSE = ("n", "no", "f", "false", "off", "0")
NOT_RECIPE_OPTIONS = ("backend", "use_autocast_during_eval", "use_mxfp8_block_scaling")


class RecipeSettingError(ValueError):
    """A recipe setting that cannot run: ``keys`` (the TERecipeKwargs fields at fault), ``fix`` (what to change, in
    the accelerate config file's words; a field's config key is its name)."""

    def __init__(self, message: str, keys=(), fix: str = ""):
        super().__init__(message)
        self.keys, self.fix = tuple(keys), fix


def settings_from_env(environ) -> tuple[object, str, dict]:
    """(recipe name or None, the setting it came from, the TERecipeKwargs fields set) from the ``ACCELERATE_FP8_*``
    variables ``environ`` holds — what the workers' ``TERecipeKwargs()`` reads; no accelerate, torch or TE import.
    A value accelerate itself would refuse raises RecipeSettingError."""
    prefix = settings.FP8_CONFIG_PREFIX
    choice = settings.parse(ENV, environ.get(ENV))
    setting = f"fp8_config `recipe` / {ENV}" if choice is not None else ""
    fields = {}
    for field, (suffix, default) in TE_KWARGS.items():
        if suffix is None:
            raw = tuple(environ.get(prefix + f"OVERRIDE_{p}") for p in ("FPROP", "DGRAD", "WGRAD"))
            if all(r is None for r in raw):
                continue
            value = tuple(_accelerate_bool("override_linear_precision", f"{prefix}OVERRIDE_{p}", r)
                          for p, r in zip(("FPROP", "DGRAD", "WGRAD"), raw))
        else:
            raw = environ.get(prefix + suffix)
            if raw is None:
                continue
            value = _accelerate_value(field, prefix + suffix, raw, default)
        if value != default:
            fields[field] = value
    return choice, setting, fields


def _accelerate_bool(field: str, variable: str, raw) -> bool:
    if raw is None:
        return False
    key = str(raw).strip().lower()
    if key in _ACCELERATE_TRUE:
        return True
    if key in _ACCELERATE_FALSE:
        return False
    raise RecipeSettingError(f"accel_fp8_fix: fp8_config.{field} ({variable})={raw!r}: accelerate accepts "
                             f"{' / '.join(_ACCELERATE_TRUE)} or {' / '.join(_ACCELERATE_FALSE)}", (field,),
                             f"{field}: false")


def _accelerate_value(field: str, variable: str, raw: str, default):
    label = f"fp8_config.{field} ({variable})"
    if isinstance(default, bool):
        return _accelerate_bool(field, variable, raw)
    if isinstance(default, int):
        try:
            return int(raw)
        except ValueError:
            raise RecipeSettingError(f"accel_fp8_fix: {label}={raw!r} is not an integer", (field,),
                                     f"{field}: {default}") from None
    accepted = FP8_FORMATS if field == "fp8_format" else AMAX_ALGOS
    value = raw.upper() if field == "fp8_format" else raw.lower()
    if value not in accepted:
        raise RecipeSettingError(f"accel_fp8_fix: {label}={raw!r}: accelerate accepts one of {', '.join(accepted)}",
                                 (field,), f"{field}: {default}")
    return value


def check_settings(choice, setting: str, fields: dict, mxfp8_flag: bool = False) -> tuple[object, str]:
    """The one validation of a recipe choice against the TERecipeKwargs fields set (``fields``: as ``to_kwargs()``
    returns them, without ``backend`` / ``use_autocast_during_eval`` / ``use_mxfp8_block_scaling``) — used by
    ``build`` (at prepare), the ``Accelerator()`` check, ``te_recipe_kwargs`` and ``doctor --launch``; imports
    neither torch nor Transformer Engine. Returns (recipe name or TE recipe object, the setting it came from);
    raises RecipeSettingError naming the setting(s) and what to change."""
    if choice is None:
        return ("mxfp8", "use_mxfp8_block_scaling") if mxfp8_flag else ("delayed", "the default")
    if mxfp8_flag and choice != "mxfp8":
        raise RecipeSettingError(f"accel_fp8_fix: use_mxfp8_block_scaling asks for MXFP8 but {setting} asks for "
                                 f"{choice!r}: choose one", ("use_mxfp8_block_scaling",),
                                 "remove use_mxfp8_block_scaling (or recipe: mxfp8)")
    if not isinstance(choice, str):  # a TE recipe object: TE checks its own fields
        return choice, setting
    class_name, _check, takes = RECIPES[choice]
    if takes is not None:
        unused = sorted(k for k in fields if k not in takes and k not in NOT_RECIPE_OPTIONS)
        if unused:
            raise RecipeSettingError(
                f"accel_fp8_fix: {', '.join(unused)} set for the {choice!r} recipe ({class_name}), which does not take "
                f"{'it' if len(unused) == 1 else 'them'} (the amax history settings are DelayedScaling's); remove the "
                "setting or choose the 'delayed' recipe", unused,
                "\n".join([f"remove `{k}: {_yaml(fields[k])}` from fp8_config" for k in unused]
                          + ["(or recipe: delayed)"]))
    return choice, setting


def _yaml(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    return str(value)


def check_handler(handler) -> tuple[object, str]:
    """``check_settings`` for accelerate's ``TERecipeKwargs`` (or None): the settings it carries, from Python and
    from the ``ACCELERATE_FP8_*`` variables it read."""
    kwargs = handler.to_kwargs() if handler is not None else {}
    mxfp8_flag = bool(kwargs.pop("use_mxfp8_block_scaling", False))
    for key in NOT_RECIPE_OPTIONS:
        kwargs.pop(key, None)
    choice, setting = _chosen(handler)
    return check_settings(choice, setting, kwargs, mxfp8_flag)


def _te_version() -> str:
    from ...engine.versions import installed_version

    return installed_version("transformer-engine") or installed_version("transformer_engine") or "?"


def _device() -> str:
    """The GPU as TE sees it (TE's own capability query; the CPU rehearsal answers for TE's frames only)."""
    try:
        from ...internals.transformer_engine import device_compute_capability, extension_is_cpu_rehearsal

        major, minor = device_compute_capability()
        where = " (the CPU rehearsal's answer)" if extension_is_cpu_rehearsal() else ""
        return f"a GPU of compute capability {major}.{minor} (sm{major}{minor}){where}"
    except Exception as exc:  # noqa: BLE001 - no CUDA device at all
        return f"no usable GPU ({type(exc).__name__}: {exc})"


def _support_check(check_name: str):
    from ...internals.transformer_engine import support_check

    return support_check(check_name)


def _chosen(handler) -> tuple[object, str]:
    """(name or recipe object, the setting it came from)."""
    from_handler = choice_of(handler).recipe
    if from_handler is not None:
        return from_handler, "te_recipe_kwargs(recipe)"
    choice = settings.get(ENV)  # ValueError naming the variable, the value and the recipes for an unknown name
    return (choice, f"fp8_config `recipe` / {ENV}") if choice is not None else (None, "")


def build(handler, checked=None):
    """(TE recipe, use_autocast_during_eval) for accelerate's ``TERecipeKwargs`` (or None), validated. ``checked``:
    what ``check_handler(handler)`` already returned (fixes/convert/fp8_plan.py passes it: the choice is not resolved
    twice)."""
    import transformer_engine.common.recipe as te_recipe

    kwargs = handler.to_kwargs() if handler is not None else {}
    kwargs.pop("backend", None)
    use_during_eval = kwargs.pop("use_autocast_during_eval", False)
    mxfp8_flag = kwargs.pop("use_mxfp8_block_scaling", False)
    choice, setting = checked if checked is not None else check_settings(*_chosen(handler), kwargs, mxfp8_flag)
    if not isinstance(choice, str):  # a TE recipe object
        _check_support(type(choice).__name__, _check_for(choice), setting)
        return choice, use_during_eval
    class_name, check_name, _takes = RECIPES[choice]
    cls = getattr(te_recipe, class_name, None)
    if cls is None:
        raise ValueError(f"accel_fp8_fix: {setting} asks for the {choice!r} recipe ({class_name}), which Transformer "
                         f"Engine {_te_version()} does not have: upgrade Transformer Engine or choose another recipe")
    if "fp8_format" in kwargs:
        kwargs["fp8_format"] = getattr(te_recipe.Format, kwargs["fp8_format"])
    kwargs.update(choice_of(handler).extra)
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
