"""What one patched ``prepare`` decides about FP8, decided once: the TE recipe (chosen, checked, then built) and
whether the weights are all-gathered in FP8. fixes/prepare.py makes the plan before anything is sharded
(:func:`plan_fp8`: an FP8 all-gather that cannot run is refused there, by name); the later steps — the
conversion's shape rule, the FP8 state, the all-gather's install, the autocast wrapper — read the plan.

The recipe is built on first use and kept: before sharding only when the all-gather under Float8 block scaling
must read the recipe's weight tiles, else after sharding, where prepare needs it — the same points (and the same
errors) as before there was a plan, each now once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from ..start import recipes
from ..start.fp8_all_gather_policy import Fp8AllGatherError, block_recipe_refusal, offloaded, refusal, requested


@dataclass(frozen=True)
class Fp8Plan:
    """The FP8 decisions of one prepare (``choice`` and ``built`` are made on first use, once)."""

    handler: object = field(repr=False)  # accelerate's TERecipeKwargs (or None)
    all_gather: bool  # the FP8 all-gather: asked for and able to run (a refusal raised in plan_fp8)
    all_gather_setting: str  # the setting that decided it

    @functools.cached_property
    def choice(self) -> tuple:
        """(recipe name or TE recipe object, the setting it came from): ``recipes.check_handler``, once."""
        return recipes.check_handler(self.handler)

    @property
    def recipe_class(self) -> str:
        """The TE recipe class asked for, by name (no TE import, no support check)."""
        choice = self.choice[0]
        return recipes.RECIPES[choice][0] if isinstance(choice, str) else type(choice).__name__

    @functools.cached_property
    def built(self) -> tuple:
        """(TE recipe, use_autocast_during_eval): ``recipes.build``, once."""
        return recipes.build(self.handler, checked=self.choice)

    @property
    def recipe(self):
        return self.built[0]

    @property
    def use_during_eval(self) -> bool:
        return self.built[1]


def plan_fp8(accelerator) -> Fp8Plan:
    """At prepare, before anything is sharded or converted: the plan; raises ``Fp8AllGatherError`` naming the
    setting and the reason when the FP8 all-gather is asked for and cannot run."""
    from ...internals.accelerate_internals import recipe_handler

    handler = recipe_handler(accelerator)
    on, setting = requested(handler)
    plan = Fp8Plan(handler, all_gather=on, all_gather_setting=setting)
    if on:
        _check_all_gather(accelerator, plan)
    return plan


def _check_all_gather(accelerator, plan: Fp8Plan) -> None:
    from ...engine.versions import installed_version

    plugin = getattr(getattr(accelerator, "state", None), "fsdp_plugin", None)
    versions = {name: installed_version(name) for name in ("transformer-engine", "torch")}
    why = refusal(plan.recipe_class, is_fsdp2=bool(accelerator.is_fsdp2), versions=versions,
                  cpu_offload=offloaded(plugin))
    if why is None and plan.recipe_class == "Float8BlockScaling":
        why = block_recipe_refusal(plan.recipe)
    if why is not None:
        raise Fp8AllGatherError(f"accel_fp8_fix: {plan.all_gather_setting}=fp8 (FP8 all-gather) cannot run: {why}. "
                                "Remove the setting (or set it to high_precision); nothing was changed")
