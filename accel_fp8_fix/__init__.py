"""accel_fp8_fix: Transformer Engine FP8 with Hugging Face accelerate on FSDP2, TP and FSDP2 x TP.

``import accel_fp8_fix`` activates the patch set that fits the installed versions (applied when
accelerate is imported, before or after this import). ``ACCEL_FP8_FIX=0`` turns every activation off.
This import never imports torch or accelerate.
"""

from ._api import (
    PatchError,
    Report,
    UnsupportedVersionError,
    activate,
    active_patch_set,
    deactivate,
    env_flag,
    report,
)

__version__ = "0.1.0"
__all__ = ["activate", "deactivate", "report", "Report", "UnsupportedVersionError", "PatchError", "__version__"]

if env_flag("ACCEL_FP8_FIX") is not False:
    activate()
