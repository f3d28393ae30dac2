"""What ``te_recipe_kwargs`` (fixes/start/recipe_kwargs.py) asked for on a handler it returned: the recipe (a name or a TE
recipe object), the extra recipe options and the FP8 all-gather choice — read back by fixes/start/recipes.py (``build``,
``check_handler``) and fixes/start/fp8_all_gather_policy.py (``requested``).

The choice cannot live on the handler: accelerate's ``to_kwargs()`` reads every instance attribute (an extra one
is a KeyError there). Nor in a ``WeakKeyDictionary``: ``TERecipeKwargs`` is a dataclass with ``eq``, so it has no
hash. It is weak-referenceable, so the store holds each handler weakly and finds it by identity (``is``): a
handler that is gone takes its choice with it, and a new handler never inherits a dead one's choice.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field


@dataclass(frozen=True)
class HandlerChoice:
    """One ``te_recipe_kwargs`` call's choice."""

    recipe: object = None  # a recipe name, a TE recipe object, or None (not chosen there)
    extra: dict = field(default_factory=dict)  # options for the TE recipe class that TERecipeKwargs lacks
    all_gather: object = None  # "fp8" / "high_precision", or None (not asked there)


NONE = HandlerChoice()


class _ByHandler:
    """handler -> HandlerChoice, by identity, each handler held weakly."""

    def __init__(self):
        self._entries: list = []  # [(weakref.ref(handler), HandlerChoice)]

    def _live_others(self, handler) -> list:
        return [(ref, choice) for ref, choice in self._entries if ref() is not None and ref() is not handler]

    def put(self, handler, choice: HandlerChoice) -> None:
        self._entries = self._live_others(handler) + [(weakref.ref(handler), choice)]

    def drop(self, handler) -> None:
        self._entries = self._live_others(handler)

    def get(self, handler) -> HandlerChoice:
        if handler is not None:
            for ref, choice in self._entries:
                if ref() is handler:
                    return choice
        return NONE


_STORE = _ByHandler()


def remember_choice(handler, recipe, extra: dict, all_gather=None) -> None:
    """What ``te_recipe_kwargs`` asked for on ``handler``."""
    _STORE.put(handler, HandlerChoice(recipe, dict(extra), all_gather))


def forget_choice(handler) -> None:
    """The choice of a handler ``te_recipe_kwargs`` refused, dropped."""
    _STORE.drop(handler)


def choice_of(handler) -> HandlerChoice:
    """The handler's choice (``NONE``: not made by ``te_recipe_kwargs``, or None)."""
    return _STORE.get(handler)


def all_gather_choice(handler):
    """What ``te_recipe_kwargs(all_gather=...)`` asked for on this handler (None: not asked there)."""
    return choice_of(handler).all_gather
