"""Deprecated alias: the collective-order audit is :mod:`accel_fp8_fix.diagnostics.collective_order` (issue 46)."""
import warnings

from ..diagnostics import collective_order as _audit

warnings.warn("accel_fp8_fix.testing.collective_order is deprecated: use accel_fp8_fix.diagnostics.collective_order",
              DeprecationWarning, stacklevel=1 if __name__ == "__main__" else 2)
__all__ = _audit.__all__


def __getattr__(name):  # every name of the audit, its recording state included
    return getattr(_audit, name)


if __name__ == "__main__":  # python -m accel_fp8_fix.testing.collective_order DIR
    raise SystemExit(_audit.main())
