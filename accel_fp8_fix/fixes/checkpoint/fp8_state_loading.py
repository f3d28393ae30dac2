"""Loading FP8 state from checkpoints without TE's unsafe-pickle opt-in (failure A12 in docs/failures.md).

Delayed scaling's ``_extra_state`` is a pickle (``get_extra_state`` in TE's ``module/base.py``). Since TE
2.18, ``set_extra_state`` refuses it (``_extra_state.py``: ``should_load_extra_state_pickle``) unless
``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1`` — so every checkpoint of a delayed-scaling run, which this
package gives FP8 state at ``prepare``, fails to load on a default install. This package never sets that
variable. Instead, the TE modules it prepares load ``_extra_state`` through :func:`safe_set_extra_state`:
the payload is decoded by a restricted unpickler that accepts exactly what TE writes — tensors, primitives, TE's
recipe classes — and refuses anything else with TE's own advisory, naming what was refused. TE's own loading code
then runs on the decoded payload (nothing re-implemented). TE's payload schema and formats (TE 1.x ``io.BytesIO``,
TE <= 2.17 stateless payloads, ignored as TE does), the decoding and the pickle-guard swap:
internals/transformer_engine/checkpoint.py.
"""

from __future__ import annotations

from types import MethodType

import torch

from ...internals import transformer_engine as te_internals
from ...internals.transformer_engine import NonConformingExtraState, decode_extra_state  # noqa: F401 (re-exported)


def safe_set_extra_state(self, state) -> None:
    original = type(self).set_extra_state
    if state is None or te_internals.carries_no_state(state) or not te_internals.has_pickle_guard():
        return original(self, state)
    payload = decode_extra_state(state, type(self).__name__)
    if payload is None:
        return None
    with te_internals.loading_decoded(payload):  # TE's set_extra_state applies the decoded payload
        return original(self, torch.ones(1, dtype=torch.uint8))


def install_safe_loading(module) -> None:
    """This TE module loads ``_extra_state`` through :func:`safe_set_extra_state` (instance attribute)."""
    if hasattr(type(module), "set_extra_state") and "set_extra_state" not in vars(module):
        module.set_extra_state = MethodType(safe_set_extra_state, module)
