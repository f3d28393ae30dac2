"""Imported at interpreter start-up by the ``accel_fp8_fix.pth`` trampoline, only when one of
``ACCEL_FP8_FIX``, ``ACCELERATE_FP8_ACCEL_FP8_FIX`` (the accelerate config flag),
``ACCEL_FP8_FIX_REHEARSAL`` or ``ACCEL_FP8_FIX_COLLECTIVE_AUDIT`` (record collectives for the cross-rank order
check, ``accel_fp8_fix.diagnostics.collective_order``) is set.

The first two activate the fixes (importing the package does). The rehearsal flag puts Transformer
Engine's real Python on CPU and opens accelerate's CPU gates (``accel_fp8_fix.rehearsal``, the separate
``accel-fp8-fix-rehearsal`` distribution) and changes nothing else: with it alone, the fixes stay off
unless the script itself does ``import accel_fp8_fix`` — the same three ways in as on a GPU. For that
import to run the package's ``__init__`` (and activate), the package object is handed back: removed from
``sys.modules`` once the rehearsal is installed (its submodules stay loaded and are reused).
"""

import sys

import accel_fp8_fix
from accel_fp8_fix import settings
from accel_fp8_fix._api import env_flag

if settings.get("ACCEL_FP8_FIX_COLLECTIVE_AUDIT"):  # a folder; 0 / off / empty: not recording
    # Record this process's collectives (from init_process_group on) for the cross-rank order check, from c10d's
    # flight recorder: turned on now, before anything can make a process group (torch reads the variable once).
    import os

    os.environ.setdefault(settings.FLIGHT_RECORDER, str(settings.FLIGHT_RECORDER_ENTRIES))
    from accel_fp8_fix.diagnostics import collective_order

    collective_order.install()

if env_flag(settings.REHEARSAL):
    try:
        from accel_fp8_fix import rehearsal
    except ImportError as exc:
        state = "fixes active" if accel_fp8_fix._api.activation_requested() else "fixes off"
        sys.stderr.write(
            f"accel_fp8_fix: ACCEL_FP8_FIX_REHEARSAL is set but the CPU rehearsal is not installed ({exc}); "
            f"from a checkout of accel_fp8_fix: {settings.REHEARSAL_INSTALL} ({state})\n"
        )
    else:
        try:
            rehearsal.install()
        except Exception as exc:  # noqa: BLE001  (the .pth would misreport the fixes as not activated)
            sys.stderr.write(f"accel_fp8_fix: CPU rehearsal not installed: {type(exc).__name__}: {exc}\n")

# No activation flag (rehearsal or audit only): the user's own `import accel_fp8_fix` must still activate.
HAND_BACK = not accel_fp8_fix._api.activation_requested()
if HAND_BACK and env_flag(settings.REHEARSAL):  # what the gates use at accelerate's import, loaded now
    import accel_fp8_fix.engine.declarations  # noqa: F401
    import accel_fp8_fix.engine.engine  # noqa: F401
    import accel_fp8_fix.engine.versions  # noqa: F401
