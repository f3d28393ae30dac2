"""Diagnostics: ``audit(model)``, error notes, ``doctor --launch`` (docs/troubleshooting.md).

Submodules load on first use: importing this package imports neither torch nor accelerate.
"""

_LAZY = {
    "audit": "audit", "AuditReport": "audit", "Coverage": "audit", "ModuleAudit": "audit", "ParamAudit": "audit",
    "explain_errors": "notes", "explain": "notes", "add_note": "notes",
    "check_launch_config": "launch_check",
}
__all__ = list(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
