"""accelerate's Transformer Engine internals: its forward wrapper.

``apply_fp8_autowrap`` wraps ``model.forward`` in ``contextual_fp8_autocast`` (TE autocast with no amax
group); this package replaces that wrapper instead of nesting inside it, recognising it by name and
unwrapping through ``__wrapped__``.
"""

from __future__ import annotations

WRAPPER_NAME = "contextual_fp8_autocast"


def check() -> list[str]:
    from ..engine.versions import installed_version

    try:
        import accelerate.utils.transformer_engine as te_utils
    except ImportError as exc:
        return [f"accelerate {installed_version('accelerate')}: accelerate.utils.transformer_engine ({exc})"]
    if not callable(getattr(te_utils, WRAPPER_NAME, None)):
        return [f"accelerate {installed_version('accelerate')}: {WRAPPER_NAME} is gone"]
    return []


def unwrap_accelerate_autocast(func):
    """The function accelerate's TE wrapper wraps, or ``func`` itself when it is not that wrapper."""
    if WRAPPER_NAME in getattr(func, "__qualname__", "") and hasattr(func, "__wrapped__"):
        return func.__wrapped__
    return func
