"""Which Transformer Engine release's Python is installed (read by the kernels and the package)."""

from __future__ import annotations


def te_version() -> str | None:
    from ...engine.versions import installed_version  # metadata only: never imports TE

    return installed_version("transformer-engine") or installed_version("transformer_engine")
