"""Imported at interpreter start-up by the ``accel_fp8_fix.pth`` trampoline, only when one of
``ACCEL_FP8_FIX``, ``ACCELERATE_FP8_ACCEL_FP8_FIX`` (the accelerate config flag) or
``ACCEL_FP8_FIX_EMULATE_TE`` is set. Importing the package activates the fixes (unless ACCEL_FP8_FIX=0);
the rehearsal flag also puts Transformer Engine's real Python on CPU and opens accelerate's CPU gates
(``accel_fp8_fix.rehearsal``)."""

import accel_fp8_fix  # noqa: F401  (activates, unless ACCEL_FP8_FIX=0)
from accel_fp8_fix._api import env_flag

if env_flag("ACCEL_FP8_FIX_EMULATE_TE"):
    from accel_fp8_fix import rehearsal

    rehearsal.install()
