"""``is_dtensor``: the one DTensor test every module of the package uses.

Importing this module does not import torch; the first call imports ``torch.distributed.tensor`` (public API
only). A torch without DTensor has none: every object is "not a DTensor".
"""

from __future__ import annotations

from typing import Any

__all__ = ["is_dtensor"]


def is_dtensor(obj: Any) -> bool:
    """True when ``obj`` is a ``torch.distributed.tensor.DTensor`` (a DTensor Parameter included)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return False
    return isinstance(obj, DTensor)
