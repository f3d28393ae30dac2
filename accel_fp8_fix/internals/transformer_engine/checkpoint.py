"""TE's checkpointed FP8 state: the ``_extra_state`` payload's schema and formats, and the extra-state pickle guard.

- the payload (``get_extra_state`` in TE's ``module/base.py``): a pickled dict of the recipe state's tensors
  (:data:`TENSOR_KEYS`), the ``recipe`` (classes of :data:`RECIPE_MODULE`) and ``extra_fp8_variables``
  (primitives) — in a uint8 tensor, or a TE 1.x ``io.BytesIO`` (``torch.save``); an empty tensor, or (TE <= 2.17) a
  stateless recipe's payload, carries no state. :func:`decode_extra_state` reads exactly that, running no code;
- the extra-state pickle guard (TE 2.18+, ``transformer_engine.pytorch._extra_state``:
  ``extra_state_pickle_advisory``, ``_classify_extra_state_pickle``, ``_PickledExtraStateAction``) and the
  temporary swap of ``module/base.py``'s ``should_load_extra_state_pickle`` / ``pickle`` globals that lets TE's
  own ``set_extra_state`` apply an already decoded payload — :func:`pickle_advisory`, :func:`ignores_extra_state`,
  :func:`has_pickle_guard`, :func:`loading_decoded`.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import pickle

from ..torch_internals import pickled_tensor_globals

# TE 2.18+ (the release that guards extra-state pickles): checked when TE has _extra_state.py.
_GUARD_FILE = "pytorch/_extra_state.py"
_GUARD_SOURCES = (
    (_GUARD_FILE, "def extra_state_pickle_advisory("),
    (_GUARD_FILE, "def _classify_extra_state_pickle("),
    (_GUARD_FILE, "class _PickledExtraStateAction("),
    (_GUARD_FILE, "IGNORE"),
    ("pytorch/module/base.py", "should_load_extra_state_pickle"),
    ("pytorch/module/base.py", "import pickle"),
)
_GUARDED = (_GUARD_FILE, _GUARD_SOURCES)  # checked when TE has the guard (internals/transformer_engine/installed.py)

RECIPE_MODULE = "transformer_engine.common.recipe"  # the only module whose classes a payload may name
TENSOR_KEYS = frozenset({"scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd", "scale_inv_fwd",
                         "scale_inv_bwd"})
ALLOWED_KEYS = TENSOR_KEYS | {"recipe", "extra_fp8_variables"}
_PRIMITIVES = (bool, int, float, str, type(None))


class NonConformingExtraState(RuntimeError):
    """The payload is not what Transformer Engine writes; raised with TE's advisory text."""


def _storage_from_bytes(data: bytes):
    """``torch.storage._load_from_bytes`` without its ``weights_only=False``."""
    import torch

    return torch.load(io.BytesIO(data), weights_only=True)


def _recipe_class(module: str, name: str):
    """TE's recipe class (or enum, named tuple) ``module.name``; None for anything else."""
    if module != RECIPE_MODULE:
        return None
    obj = getattr(importlib.import_module(module), name, None)
    return obj if isinstance(obj, type) and obj.__module__ == module else None


class _TEStateUnpickler(pickle.Unpickler):
    """Finds only what TE's payload names: an OrderedDict, torch's tensor-rebuild globals
    (internals/torch_internals.py), ``torch.Size``, torch dtypes and TE's recipe classes."""

    def find_class(self, module, name):
        import torch
        from collections import OrderedDict

        safe = {("collections", "OrderedDict"): OrderedDict, **pickled_tensor_globals(_storage_from_bytes),
                ("torch", "Size"): torch.Size}
        if (module, name) in safe:
            return safe[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        recipe_class = _recipe_class(module, name)
        if recipe_class is not None:
            return recipe_class
        raise pickle.UnpicklingError(f"refused global {module}.{name}")


def _advisory(context: str) -> str:
    advisory = pickle_advisory(context)
    if advisory is None:  # TE < 2.18 has no guard (and no advisory)
        return f"Refusing to load pickled Transformer Engine extra state for {context}."
    return advisory


def _check_payload(payload, context: str):
    import torch

    if not isinstance(payload, dict) or not set(payload) <= ALLOWED_KEYS:
        keys = sorted(payload) if isinstance(payload, dict) else type(payload).__name__
        raise NonConformingExtraState(f"{_advisory(context)} (accel_fp8_fix: not a TE FP8 state payload: {keys})")
    for key in TENSOR_KEYS & set(payload):
        if not isinstance(payload[key], torch.Tensor):
            raise NonConformingExtraState(f"{_advisory(context)} (accel_fp8_fix: {key} is not a tensor)")
    extra = payload.get("extra_fp8_variables", {})
    bad = [k for k, v in (extra.items() if isinstance(extra, dict) else [("extra_fp8_variables", extra)])
           if not isinstance(v, _PRIMITIVES + (tuple, list))]
    if bad:
        raise NonConformingExtraState(f"{_advisory(context)} (accel_fp8_fix: non-primitive values {bad})")
    return payload


def decode_extra_state(state, context: str):
    """The dict TE pickled into ``state`` (uint8 tensor, or TE 1.x ``io.BytesIO``), decoded without running
    arbitrary code; ``None`` for an empty state. Raises :class:`NonConformingExtraState` otherwise."""
    import torch

    if isinstance(state, io.BytesIO):
        state.seek(0)
        recipe_classes = [obj for obj in vars(importlib.import_module(RECIPE_MODULE)).values()
                          if isinstance(obj, type) and obj.__module__ == RECIPE_MODULE]
        try:
            with torch.serialization.safe_globals(recipe_classes):
                payload = torch.load(state, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            raise NonConformingExtraState(f"{_advisory(context)} (accel_fp8_fix: {exc})") from None
        return _check_payload(payload, context)
    data = state.detach().cpu().numpy().tobytes()
    if not data:
        return None
    try:
        payload = _TEStateUnpickler(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, AttributeError, EOFError, ValueError) as exc:
        raise NonConformingExtraState(f"{_advisory(context)} (accel_fp8_fix: {exc})") from None
    return _check_payload(payload, context)


def carries_no_state(state) -> bool:
    """TE ignores this ``_extra_state`` on load: an empty tensor, or one its own classifier (2.18+) finds
    stateless (a stateless recipe's payload); False for anything else (a TE 1.x ``io.BytesIO`` included)."""
    import torch

    if not isinstance(state, torch.Tensor):
        return False
    if state.numel() == 0:
        return True
    return ignores_extra_state(state.detach().cpu().numpy().tobytes())


# -- the extra-state pickle guard (TE 2.18+) --------------------------------------------------------------


def pickle_advisory(context: str) -> str | None:
    """TE's advisory refusing a pickled extra state for ``context``, or None for a TE without the guard."""
    try:
        from transformer_engine.pytorch._extra_state import extra_state_pickle_advisory
    except ImportError:  # TE < 2.18 has no guard (and no advisory)
        return None
    return extra_state_pickle_advisory(context)


def ignores_extra_state(data: bytes) -> bool:
    """TE's own classifier (2.18+) says this pickled extra state carries no state (stateless recipe); False
    for a TE without it."""
    try:
        from transformer_engine.pytorch._extra_state import _classify_extra_state_pickle, _PickledExtraStateAction
    except ImportError:
        return False
    return _classify_extra_state_pickle(data) is _PickledExtraStateAction.IGNORE


def _module_base():
    import importlib

    return importlib.import_module("transformer_engine.pytorch.module.base")


def has_pickle_guard() -> bool:
    """TE's ``set_extra_state`` (module/base.py) guards its ``pickle.loads`` (TE 2.18+)."""
    base = _module_base()
    return hasattr(base, "should_load_extra_state_pickle") and hasattr(base, "pickle")


@contextlib.contextmanager
def loading_decoded(payload):
    """While inside, TE's ``set_extra_state`` (module/base.py) finds its pickle guard answered and
    ``pickle.loads`` returning the already decoded ``payload``: TE's own code applies it. Restored on exit."""
    import pickle
    from types import SimpleNamespace

    base = _module_base()
    saved = {"should_load_extra_state_pickle": base.should_load_extra_state_pickle, "pickle": base.pickle}
    base.should_load_extra_state_pickle = lambda data, context: True
    base.pickle = SimpleNamespace(loads=lambda data: payload, dumps=pickle.dumps)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(base, name, value)

