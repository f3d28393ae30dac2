"""Which Transformer Engine release's Python is installed (read by the kernels and the package; imports nothing)."""

from __future__ import annotations


def te_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("transformer-engine", "transformer_engine"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None
