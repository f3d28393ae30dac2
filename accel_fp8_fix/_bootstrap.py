"""Imported at interpreter start-up by the ``accel_fp8_fix.pth`` trampoline, only when one of
``ACCEL_FP8_FIX``, ``ACCELERATE_FP8_ACCEL_FP8_FIX`` (the accelerate config flag) or
``ACCEL_FP8_FIX_EMULATE_TE`` is set. Importing the package activates the fixes (unless ACCEL_FP8_FIX=0);
the rehearsal flag also puts Transformer Engine's real Python on CPU and opens accelerate's CPU gates
(``accel_fp8_fix.rehearsal``, the separate ``accel-fp8-fix-rehearsal`` distribution)."""

import sys

import accel_fp8_fix  # noqa: F401  (activates, unless ACCEL_FP8_FIX=0)
from accel_fp8_fix._api import env_flag

if env_flag("ACCEL_FP8_FIX_EMULATE_TE"):
    try:
        from accel_fp8_fix import rehearsal
    except ImportError as exc:
        state = "fixes active" if accel_fp8_fix.active_patch_set() is not None or env_flag("ACCEL_FP8_FIX") is not False else "fixes off"
        sys.stderr.write(
            f"accel_fp8_fix: ACCEL_FP8_FIX_EMULATE_TE is set but the CPU rehearsal is not installed ({exc}); "
            f"pip install accel-fp8-fix-rehearsal ({state})\n"
        )
    else:
        try:
            rehearsal.install()
        except Exception as exc:  # noqa: BLE001  (the .pth would misreport the fixes as not activated)
            sys.stderr.write(f"accel_fp8_fix: CPU rehearsal not installed: {type(exc).__name__}: {exc}\n")
