"""What passes between the stages of one prepared accelerator and model, held by the package (issue 46 item 2),
never as attributes on accelerate's, torch's or TE's objects.

- :func:`preparing` / :func:`inside_prepare`: "this accelerator is inside a patched ``prepare``", a
  :class:`~contextvars.ContextVar` — the inner calls of that prepare (``_prepare_tp``, ``_prepare_te``,
  ``prepare_model``) see it, a prepare of another accelerator or in another thread does not;
- :func:`record`: the accelerator's :class:`AcceleratorRecord`, looked up by identity and held weakly (an accelerator
  that goes away takes its record with it);
- :func:`module_record` / :func:`module_record_of`: what the stages learn about one module of a prepared model (its
  TP layout, whether it is the output layer, the group its FP8 state is shared over, whether its experts run in TE),
  held the same way: nothing of it sits on the module (a ``copy.deepcopy`` of a module copies no record and no
  process group of the package's; the copy has no record).
"""

from __future__ import annotations

import contextlib
import weakref
from contextvars import ContextVar
from dataclasses import dataclass

from ... import caches

_PREPARING: ContextVar = ContextVar("accel_fp8_fix_preparing", default=None)


@dataclass
class AcceleratorRecord:
    """One accelerator's state between stages."""

    agreed: bool = False  # its ranks checked that they run the same patch set (distributed/agreement.py)
    pending_model: object = None  # the model Trainer prepared alone, kept for the optimizer's prepare (A22)


_RECORDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _made_on_first_use(records: weakref.WeakKeyDictionary, owner, make):
    found = records.get(owner)
    if found is None:
        found = records[owner] = make()
    return found


def record(accelerator) -> AcceleratorRecord:
    """The accelerator's record (made on first use)."""
    return _made_on_first_use(_RECORDS, accelerator, AcceleratorRecord)


@dataclass
class ModuleRecord:
    """One module's facts between stages."""

    tp_mode: str | None = None  # "column" / "row" / None (replicated): how TP shards it, read before FSDP2 wraps it
    tp_mesh: object = None  # the TP mesh it is sharded (or replicated) on; None: not under TP
    output_layer: bool = False  # the model's output embedding (lm_head): kept as transformers shards it
    amax_group: object = None  # the group its FP8 state is shared over, when not the model's (EP experts' runners)
    te_experts: bool = False  # a packed-experts module whose GEMMs run in TE (fixes/convert/moe_experts.py)


_MODULE_RECORDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def module_record(module) -> ModuleRecord:
    """The module's record (made on first use)."""
    return _made_on_first_use(_MODULE_RECORDS, module, ModuleRecord)


_NONE = ModuleRecord()


def module_record_of(module) -> ModuleRecord:
    """The module's record, or an empty one (not stored) when it has none."""
    return _MODULE_RECORDS.get(module, _NONE)


def _forget_all() -> None:
    _RECORDS.clear()
    _MODULE_RECORDS.clear()


caches.register("fixes.convert.run_state: accelerator and module records", _forget_all)


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
