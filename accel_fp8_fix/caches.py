"""One place that knows every module-level cache of the package (issue 46 item 2): each module registers how to
empty its own when it is imported, and :func:`reset` empties them all — what a process that runs several jobs one
after another (the test bed's rank pools) calls between them. A leaf: imports nothing from the package."""

from __future__ import annotations

from typing import Callable

_RESETS: dict[str, Callable[[], None]] = {}


def register(name: str, reset_one: Callable[[], None]) -> None:
    """``reset_one()`` empties the cache named ``name`` ("module: what"); registering a name again replaces it."""
    _RESETS[name] = reset_one


def registered() -> list[str]:
    return sorted(_RESETS)


def reset() -> list[str]:
    """Empty every registered cache (of the modules imported so far); the names, in registration order."""
    for reset_one in list(_RESETS.values()):
        reset_one()
    return list(_RESETS)
