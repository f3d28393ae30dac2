"""The patch engine: version-pinned patch sets (declared in ``patches/``) applied with wrapt."""

from .declarations import DeclarationError, PatchSet, PatchSpec, Selection, load_patch_sets, select_patch_set
from .engine import Engine, FixWrapper, PatchError
from .versions import installed_version, installed_versions

__all__ = [
    "DeclarationError",
    "Engine",
    "FixWrapper",
    "PatchError",
    "PatchSet",
    "PatchSpec",
    "Selection",
    "installed_version",
    "installed_versions",
    "load_patch_sets",
    "select_patch_set",
]
