"""``Accelerator.prepare``: the entry point of every fix (rank agreement, then the FP8-aware pipeline)."""

from __future__ import annotations

from .._api import active_patch_set
from ..distributed.agreement import check_patch_set_agreement


def prepare(wrapped, instance, args, kwargs):
    if not getattr(instance, "_accel_fp8_fix_agreed", False):
        check_patch_set_agreement(active_patch_set())
        instance._accel_fp8_fix_agreed = True
    return wrapped(*args, **kwargs)
