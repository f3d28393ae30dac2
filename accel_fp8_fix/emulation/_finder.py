"""``sys.meta_path`` finder that makes ``transformer_engine.*`` aliases of the emulation's modules.

No torch import here: ``transformer_engine`` and ``transformer_engine.common(.recipe)`` are pure
Python; torch is imported only when ``transformer_engine.pytorch`` is.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import sys

from ._version import DIST_VERSION

ALIAS_ROOT = "transformer_engine"
TARGET_ROOT = __name__.rsplit(".", 1)[0] + ".te"  # accel_fp8_fix.emulation.te
DIST_NAMES = {"transformer_engine", "transformer-engine"}


def target_name(fullname: str) -> str:
    return TARGET_ROOT + fullname[len(ALIAS_ROOT):]


class _AliasLoader(importlib.abc.Loader):
    """Loads an alias by importing the emulation module and putting *that object* in sys.modules."""

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec):
        return None  # default placeholder, replaced in exec_module

    def exec_module(self, module) -> None:
        real = importlib.import_module(self.target)
        # importlib re-reads sys.modules[name] after exec_module, so the caller gets `real`:
        # one module object, one class identity, under both names.
        sys.modules[module.__name__] = real


class _EmulatedTEDistribution(importlib.metadata.Distribution):
    """Metadata of the emulated ``transformer-engine`` distribution (version ``X.Y.Z+emulated``)."""

    _FILES = {
        "METADATA": (
            "Metadata-Version: 2.1\n"
            "Name: transformer-engine\n"
            f"Version: {DIST_VERSION}\n"
            "Summary: CPU emulation of NVIDIA Transformer Engine provided by accel_fp8_fix "
            "(not the real package)\n"
        ),
        "top_level.txt": "transformer_engine\n",
        "INSTALLER": "accel_fp8_fix.emulation\n",
    }

    def read_text(self, filename):
        if filename == "PKG-INFO":
            filename = "METADATA"
        return self._FILES.get(filename)

    def locate_file(self, path):
        import pathlib

        return pathlib.Path(__file__).parent / "te" / str(path)


class EmulatedTEFinder(importlib.abc.MetaPathFinder):
    """Answers ``transformer_engine[.*]`` imports and the ``transformer-engine`` distribution."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != ALIAS_ROOT and not fullname.startswith(ALIAS_ROOT + "."):
            return None
        tname = target_name(fullname)
        try:
            tspec = importlib.util.find_spec(tname)
        except (ImportError, ValueError):
            return None
        if tspec is None:
            return None
        spec = importlib.machinery.ModuleSpec(
            fullname, _AliasLoader(tname), is_package=tspec.submodule_search_locations is not None
        )
        if tspec.submodule_search_locations is not None:
            spec.submodule_search_locations = list(tspec.submodule_search_locations)
        return spec

    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
        name = getattr(context, "name", None)
        if name is None:
            yield _EmulatedTEDistribution()
            return
        norm = name.lower().replace("-", "_").replace(".", "_")
        if norm == "transformer_engine":
            yield _EmulatedTEDistribution()

    def invalidate_caches(self):
        pass

    def __repr__(self) -> str:
        return f"<EmulatedTEFinder transformer_engine -> {TARGET_ROOT} ({DIST_VERSION})>"
