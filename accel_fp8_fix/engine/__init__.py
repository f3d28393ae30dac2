"""The patch engine: version-pinned patch sets (declared in ``patches/``) applied with wrapt.

Names are loaded on first use (PEP 562) so that ``import accel_fp8_fix`` stays cheap.
"""

_EXPORTS = {
    "DeclarationError": "declarations",
    "PatchSet": "declarations",
    "PatchSpec": "declarations",
    "Selection": "declarations",
    "load_patch_sets": "declarations",
    "select_patch_set": "declarations",
    "Engine": "engine",
    "FixWrapper": "engine",
    "PatchError": "errors",
    "installed_version": "versions",
    "installed_versions": "versions",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
