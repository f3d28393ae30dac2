"""What passes between the stages of one prepared accelerator, held by the package (issue 46 item 2), never as
attributes on accelerate's objects.

- :func:`preparing` / :func:`inside_prepare`: "this accelerator is inside a patched ``prepare``", a
  :class:`~contextvars.ContextVar` — the inner calls of that prepare (``_prepare_tp``, ``_prepare_te``,
  ``prepare_model``) see it, a prepare of another accelerator or in another thread does not;
- :func:`record`: the accelerator's :class:`AcceleratorRecord`, looked up by identity and held weakly (an accelerator
  that goes away takes its record with it).
"""

from __future__ import annotations

import contextlib
import weakref
from contextvars import ContextVar
from dataclasses import dataclass

_PREPARING: ContextVar = ContextVar("accel_fp8_fix_preparing", default=None)


@dataclass
class AcceleratorRecord:
    """One accelerator's state between stages."""

    agreed: bool = False  # its ranks checked that they run the same patch set (distributed/agreement.py)
    pending_model: object = None  # the model Trainer prepared alone, kept for the optimizer's prepare (A22)


_RECORDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def record(accelerator) -> AcceleratorRecord:
    """The accelerator's record (made on first use)."""
    found = _RECORDS.get(accelerator)
    if found is None:
        found = _RECORDS[accelerator] = AcceleratorRecord()
    return found


def inside_prepare(accelerator) -> bool:
    """True inside a patched ``prepare`` of this accelerator (its inner calls: convert after sharding, not before)."""
    return _PREPARING.get() is accelerator


@contextlib.contextmanager
def preparing(accelerator):
    token = _PREPARING.set(accelerator)
    try:
        yield
    finally:
        _PREPARING.reset(token)
