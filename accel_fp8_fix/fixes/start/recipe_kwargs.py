"""``accel_fp8_fix.te_recipe_kwargs``: accelerate's ``TERecipeKwargs`` carrying a TE recipe choice (and the FP8
all-gather switch), every field checked here — not at ``prepare``. Above fixes/start/recipes.py (the recipe table and its
checks), fixes/start/fp8_all_gather_policy.py (when the FP8 all-gather can run), which it asks, and
fixes/start/handler_choices.py (the handler's recorded choice), where it writes.
"""

from __future__ import annotations

from ... import settings
from .fp8_all_gather_policy import Fp8AllGatherError, refusal
from .handler_choices import forget_choice, remember_choice
from .recipes import RECIPES, check_handler, recipe_name


def te_recipe_kwargs(recipe="delayed", all_gather=None, **fields):
    """accelerate's ``TERecipeKwargs(**fields)`` that asks for ``recipe`` (a name or a TE recipe object).

    Fields ``TERecipeKwargs`` does not have are passed to the TE recipe class (e.g. ``fp4_format``); a field neither
    has raises ``TypeError`` naming it, and a field the recipe does not take (``amax_history_len`` with
    ``current``) raises ``ValueError`` — here, not at ``prepare``."""
    import dataclasses

    from accelerate.utils import TERecipeKwargs

    known = {f.name for f in dataclasses.fields(TERecipeKwargs)}
    extra = {k: v for k, v in fields.items() if k not in known}
    if isinstance(recipe, str):
        recipe = recipe_name(recipe, "te_recipe_kwargs(recipe)")
    _check_extra_fields(recipe, extra, known)
    if all_gather is not None:
        all_gather = settings.REGISTRY["ACCELERATE_FP8_ALL_GATHER"].parse(all_gather)
        if all_gather == "fp8" and isinstance(recipe, str):
            why = refusal(RECIPES[recipe][0], is_fsdp2=True)
            if why is not None:
                raise Fp8AllGatherError(f"accel_fp8_fix: te_recipe_kwargs(all_gather='fp8') cannot run with {why}")
    handler = TERecipeKwargs(**{k: v for k, v in fields.items() if k in known})
    remember_choice(handler, recipe, extra, all_gather)
    try:
        check_handler(handler)
    except ValueError:
        forget_choice(handler)
        raise
    return handler


def _check_extra_fields(recipe, extra: dict, known: set) -> None:
    if not extra:
        return
    if not isinstance(recipe, str):
        unknown, takes = sorted(extra), f"a {type(recipe).__name__} object (set them on it)"
    else:
        class_name = RECIPES[recipe][0]
        recipe_fields = _te_recipe_fields(class_name)
        if recipe_fields is None:  # TE's recipe module not importable here: TE's constructor decides at prepare
            return
        unknown, takes = sorted(k for k in extra if k not in recipe_fields), f"{class_name}"
    if unknown:
        raise TypeError(f"te_recipe_kwargs() got unknown field{'s' if len(unknown) > 1 else ''} "
                        f"{', '.join(map(repr, unknown))} for the {recipe if isinstance(recipe, str) else 'given'} "
                        f"recipe: neither TERecipeKwargs ({', '.join(sorted(known))}) nor {takes} has "
                        f"{'it' if len(unknown) == 1 else 'them'}")


def _te_recipe_fields(class_name: str):
    """The fields of TE's recipe class ``class_name`` (None when TE's recipe module cannot be imported)."""
    import dataclasses

    try:
        import transformer_engine.common.recipe as te_recipe
    except Exception:  # noqa: BLE001 - TE absent or unusable here
        return None
    cls = getattr(te_recipe, class_name, None)
    if cls is None:
        return set()
    try:
        return {f.name for f in dataclasses.fields(cls)}
    except TypeError:
        import inspect

        return set(inspect.signature(cls).parameters)
