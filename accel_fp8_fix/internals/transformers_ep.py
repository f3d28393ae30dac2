"""transformers expert-parallel internals: the token dispatch an ``ep_dispatch_experts`` module runs.

transformers 5.x (``distributed/expert_parallel.py``) installs an *instance* ``forward`` (``ep_forward``) on an
experts module that closes over an ``EPImplementation`` object; that object kept the experts' own forward as
``experts_forward`` when the plan was applied and calls it on this rank's rows with local expert ids. ``AutoEP``
holds an ``AllToAllEP`` (training) and, when the EP group shares one batch, an ``AllReduceEP`` (inference: routes
to other ranks' experts carry the sentinel id ``num_local_experts`` and weight 0). ``MegaMoeEP`` runs DeepGEMM's
fused kernel, which has no backward: refused. Anything else fails closed (the experts stay in high precision,
named). Whether the dispatch's source is a tested release's is checked by hash (internals/transformers_features.py:
``expert_parallel``).
"""

from __future__ import annotations

KNOWN = ("AllToAllEP", "AllReduceEP", "AutoEP")


def dispatch(module):
    """The ``EPImplementation`` closed over by ``module``'s transformers EP forward, or None."""
    forward = module.__dict__.get("forward")
    code = getattr(forward, "__code__", None)
    if code is None or "implementation" not in code.co_freevars:
        return None
    cells = dict(zip(code.co_freevars, forward.__closure__ or ()))
    try:
        return cells["implementation"].cell_contents
    except ValueError:
        return None


def _callers(implementation) -> list:
    """The implementation objects that call ``experts_forward`` (AutoEP: itself and the ones it delegates to)."""
    found = [implementation]
    for attr in ("all_to_all", "all_reduce", "megamoe"):
        inner = getattr(implementation, attr, None)
        if inner is not None:
            found.append(inner)
    return found


def unsupported(module) -> str | None:
    """Why this package cannot run ``module``'s experts under its transformers EP dispatch; None when it can."""
    implementation = dispatch(module)
    if implementation is None:
        return ("expert parallelism whose token dispatch this package does not recognise (no transformers "
                "ep_dispatch_experts forward on the module)")
    names = sorted({type(c).__name__ for c in _callers(implementation)})
    unknown = [n for n in names if n not in KNOWN]
    if unknown:
        return f"expert parallelism through {', '.join(unknown)}: not supported (known: {', '.join(KNOWN)})"
    if not all(hasattr(c, "experts_forward") for c in _callers(implementation)):
        return "expert parallelism whose EPImplementation has no experts_forward (transformers changed it)"
    return None


def replace_experts_forward(module, forward) -> bool:
    """Make ``forward`` what ``module``'s EP dispatch calls on this rank's rows; True when done."""
    implementation = dispatch(module)
    if implementation is None or unsupported(module) is not None:
        return False
    for caller in _callers(implementation):
        caller.experts_forward = forward
    return True
