"""Loading FP8 state from checkpoints without TE's unsafe-pickle opt-in (failure A12 in docs/failures.md).

Delayed scaling's ``_extra_state`` is a pickle (``get_extra_state`` in TE's ``module/base.py``). Since TE
2.18, ``set_extra_state`` refuses it (``_extra_state.py``: ``should_load_extra_state_pickle``) unless
``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1`` — so every checkpoint of a delayed-scaling run, which this
package gives FP8 state at ``prepare``, fails to load on a default install. This package never sets that
variable. Instead, the TE modules it prepares load ``_extra_state`` through :func:`decode_extra_state`:
a restricted unpickler that accepts exactly what TE writes — tensors, primitives, TE's recipe classes —
and refuses anything else with TE's own advisory, naming what was refused. TE's own loading code then
runs on the decoded payload (nothing re-implemented). Also read: TE 1.x ``io.BytesIO`` checkpoints
(``torch.load(weights_only=True)``) and TE <= 2.17 payloads of stateless recipes (ignored, as TE does).
"""

from __future__ import annotations

import importlib
import io
import pickle
from collections import OrderedDict
from types import MethodType

import torch

from ...internals import transformer_engine as te_internals
from ...internals.torch_internals import pickled_tensor_globals

_RECIPE_MODULE = "transformer_engine.common.recipe"
_TENSOR_KEYS = {"scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd", "scale_inv_fwd", "scale_inv_bwd"}
_ALLOWED_KEYS = _TENSOR_KEYS | {"recipe", "extra_fp8_variables"}
_PRIMITIVES = (bool, int, float, str, type(None))


def _storage_from_bytes(data: bytes):
    """``torch.storage._load_from_bytes`` without its ``weights_only=False``."""
    return torch.load(io.BytesIO(data), weights_only=True)


_SAFE_GLOBALS = {
    ("collections", "OrderedDict"): OrderedDict,
    **pickled_tensor_globals(_storage_from_bytes),  # torch's tensor-rebuild globals (internals/torch_internals.py)
    ("torch", "Size"): torch.Size,
}


class _TEStateUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in _SAFE_GLOBALS:
            return _SAFE_GLOBALS[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == _RECIPE_MODULE:
            obj = getattr(importlib.import_module(module), name, None)
            if isinstance(obj, type) and obj.__module__ == module:
                return obj  # TE's recipe classes, their enums and named tuples
        raise pickle.UnpicklingError(f"refused global {module}.{name}")


class NonConformingExtraState(RuntimeError):
    """The payload is not what Transformer Engine writes; raised with TE's advisory text."""


def _advisory(context: str) -> str:
    advisory = te_internals.pickle_advisory(context)
    if advisory is None:  # TE < 2.18 has no guard (and no advisory)
        return f"Refusing to load pickled Transformer Engine extra state for {context}."
    return advisory


def _check_payload(payload, context: str):
    if not isinstance(payload, dict) or not set(payload) <= _ALLOWED_KEYS:
        keys = sorted(payload) if isinstance(payload, dict) else type(payload).__name__
        raise NonConformingExtraState(f"{_advisory(context)} (accel_fp8_fix: not a TE FP8 state payload: {keys})")
    for key in _TENSOR_KEYS & set(payload):
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
    if isinstance(state, io.BytesIO):
        state.seek(0)
        recipe_classes = [obj for obj in vars(importlib.import_module(_RECIPE_MODULE)).values()
                          if isinstance(obj, type) and obj.__module__ == _RECIPE_MODULE]
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


def _te_ignores(state) -> bool:
    """TE's own classifier (2.18+) says the payload carries no state (empty, stateless recipe)."""
    if not isinstance(state, torch.Tensor):
        return False
    if state.numel() == 0:
        return True
    return te_internals.ignores_extra_state(state.detach().cpu().numpy().tobytes())


def _te_loads(payload):
    """TE's ``set_extra_state`` (module/base.py) with its pickle guard answered and ``pickle.loads``
    returning the already decoded ``payload``: TE's own code applies it (the swap: internals)."""
    return te_internals.loading_decoded(payload)


def _guarded_te() -> bool:
    return te_internals.has_pickle_guard()


def safe_set_extra_state(self, state) -> None:
    original = type(self).set_extra_state
    if state is None or _te_ignores(state) or not _guarded_te():
        return original(self, state)
    payload = decode_extra_state(state, type(self).__name__)
    if payload is None:
        return None
    with _te_loads(payload):
        return original(self, torch.ones(1, dtype=torch.uint8))


def install_safe_loading(module) -> None:
    """This TE module loads ``_extra_state`` through :func:`safe_set_extra_state` (instance attribute)."""
    if hasattr(type(module), "set_extra_state") and "set_extra_state" not in vars(module):
        module.set_extra_state = MethodType(safe_set_extra_state, module)
