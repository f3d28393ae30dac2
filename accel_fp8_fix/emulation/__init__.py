"""CPU *emulation* of NVIDIA Transformer Engine (the part accelerate touches), for rehearsals.

    import accel_fp8_fix.emulation as emu
    emu.install()                      # or ACCEL_FP8_FIX_EMULATE_TE=1 (see _bootstrap)
    import transformer_engine.pytorch as te   # -> accel_fp8_fix.emulation.te.pytorch

``install()`` is cheap and does not import torch; torch is imported when ``transformer_engine.pytorch``
is. It refuses to shadow a real, importable Transformer Engine unless ``force=True`` (or
``ACCEL_FP8_FIX_EMULATE_TE=force``). This is never the real TE: no kernels, no GPU speed; FP8 numerics
are emulated by quantize -> dequantize -> fp32 GEMM.
"""

from __future__ import annotations

import importlib
import os
import sys

from ._stats import reset_stats, stats
from ._version import DIST_VERSION, EMULATED_TE_VERSION

__all__ = [
    "install",
    "uninstall",
    "is_installed",
    "stats",
    "reset_stats",
    "EMULATED_TE_VERSION",
    "DIST_VERSION",
    "ENV_EMULATE",
    "ENV_MXFP8",
]

ENV_EMULATE = "ACCEL_FP8_FIX_EMULATE_TE"  # "1" to install at startup (via _bootstrap), "force" to shadow real TE
ENV_MXFP8 = "ACCEL_FP8_FIX_EMULATE_MXFP8"  # "1": check_mxfp8_support() says True and MXFP8 is emulated

_finder = None


def _find_real_te():
    """Location of a real ``transformer_engine`` findable without the emulation, else None."""
    mod = sys.modules.get("transformer_engine")
    if mod is not None and not getattr(mod, "__emulated__", False):
        return getattr(mod, "__file__", None) or repr(mod)
    for finder in sys.meta_path:
        if finder is _finder or type(finder).__name__ == "EmulatedTEFinder":
            continue
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is None:
            continue
        try:
            spec = find_spec("transformer_engine", None)
        except Exception:  # a broken third-party finder must not break install()
            continue
        # A bare namespace directory (no __init__.py) is not an importable TE package.
        if spec is not None and spec.origin not in (None, "namespace"):
            return spec.origin
    return None


def is_installed() -> bool:
    return _finder is not None and _finder in sys.meta_path


def install(force: bool = False):
    """Make ``import transformer_engine[.pytorch|.common|.common.recipe|.pytorch.fp8|...]`` resolve to
    the emulation and report a ``transformer-engine`` distribution of version ``DIST_VERSION``.

    Idempotent. Raises ``RuntimeError`` if a real Transformer Engine is importable, unless ``force`` or
    ``ACCEL_FP8_FIX_EMULATE_TE=force``. Returns the finder.
    """
    global _finder
    if is_installed():
        return _finder
    force = force or os.environ.get(ENV_EMULATE, "").strip().lower() == "force"
    if not force:
        real = _find_real_te()
        if real is not None:
            raise RuntimeError(
                "accel_fp8_fix.emulation: a real Transformer Engine is importable at "
                f"{real}; refusing to shadow it with the CPU emulation. Pass install(force=True) "
                f"(or set {ENV_EMULATE}=force) to use the emulation anyway."
            )
    from ._finder import EmulatedTEFinder

    _finder = EmulatedTEFinder()
    sys.meta_path.insert(0, _finder)
    importlib.invalidate_caches()
    return _finder


def uninstall() -> None:
    """Remove the finder and every ``transformer_engine*`` entry of sys.modules that is an emulation alias."""
    global _finder
    if _finder is not None:
        try:
            sys.meta_path.remove(_finder)
        except ValueError:
            pass
    _finder = None
    for name in list(sys.modules):
        if name == "transformer_engine" or name.startswith("transformer_engine."):
            mod = sys.modules.get(name)
            modname = getattr(mod, "__name__", "") or ""
            if modname.startswith(__name__ + ".") or getattr(mod, "__emulated__", False):
                del sys.modules[name]
    importlib.invalidate_caches()

