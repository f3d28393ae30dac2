"""accel_fp8_fix: Transformer Engine FP8 with Hugging Face accelerate on FSDP2, TP and FSDP2 x TP.

``import accel_fp8_fix`` activates the patch set that fits the installed versions (applied when
accelerate is imported, before or after this import). ``ACCEL_FP8_FIX=0`` turns every activation off.
This import never imports torch or accelerate.
"""

import sys as _sys

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
__all__ = ["activate", "deactivate", "report", "Report", "UnsupportedVersionError", "PatchError", "audit", "te_recipe_kwargs",
           "newest_complete_checkpoint", "IncompleteCheckpointError", "__version__"]


def __getattr__(name):
    """``audit`` (accel_fp8_fix.diagnostics.audit.audit), ``te_recipe_kwargs`` (fixes/start/recipe_kwargs.py) and the
    checkpoint completeness names (fixes/checkpoint/checkpoint_complete.py) load on first use: this import stays free
    of torch."""
    if name == "audit":
        from .diagnostics.audit import audit

        return audit
    if name == "te_recipe_kwargs":
        from .fixes.start.recipe_kwargs import te_recipe_kwargs

        return te_recipe_kwargs
    if name in ("newest_complete_checkpoint", "IncompleteCheckpointError"):
        from .fixes.checkpoint import checkpoint_complete

        return getattr(checkpoint_complete, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Submodules imported before this package object existed (see _bootstrap: a rehearsal-only start-up
# hands the package back to the user's own import) stay reachable as attributes.
for _name, _module in list(_sys.modules.items()):
    if _name.startswith(__name__ + ".") and _name.count(".") == 1 and _module is not None:
        globals().setdefault(_name.rpartition(".")[2], _module)


def _by_startup_hook_for_the_rehearsal_only() -> bool:
    """This import is the ``.pth`` start-up hook's (``site.addpackage``) and no activation flag is set (the
    rehearsal or the collective audit alone): those change where TE comes from, or record, and nothing else,
    so no activation here."""
    if env_flag("ACCEL_FP8_FIX") or env_flag("ACCELERATE_FP8_ACCEL_FP8_FIX"):
        return False
    site = _sys.modules.get("site")
    site_py = getattr(site, "__file__", None) or "site.py"  # "<frozen site>" since Python 3.11
    frame = _sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "addpackage" and frame.f_code.co_filename in ("<frozen site>", site_py):
            return True
        frame = frame.f_back
    return False


if env_flag("ACCEL_FP8_FIX") is not False and not _by_startup_hook_for_the_rehearsal_only():
    activate()
