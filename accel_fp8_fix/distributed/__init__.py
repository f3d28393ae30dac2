"""Collectives that name their group explicitly, ``is_dtensor``, and the cross-rank agreement check.

Public, for your own hooks and callbacks (semantics per placement: docs/troubleshooting.md)::

    from accel_fp8_fix.distributed import broadcast, all_reduce, all_gather
    broadcast(dtensor)                       # along its replicated mesh dims, from each group's first rank
    all_reduce(grad, mesh, "dp_shard")       # a plain tensor: say where it lives (mesh + dims, or group=)
    full = all_gather(dtensor)               # the full tensor, as a plain tensor

The same family moves what only one rank knows the shape of (``broadcast_variable``) and picklable objects
(``broadcast_object``, ``all_gather_object``), each taking the mesh (and dims) or ``group=`` explicitly.
They never hand a DTensor to c10d and never promote a plain tensor to a DTensor (that would assume it is
replicated). Loaded on first use: importing this package does not import torch.
"""

_COLLECTIVES = ("broadcast", "all_reduce", "all_gather", "broadcast_variable", "broadcast_object",
                "all_gather_object", "group_of", "CollectiveError")
_PUBLIC = (*_COLLECTIVES, "is_dtensor")
__all__ = list(_PUBLIC)


def __getattr__(name):
    if name in _COLLECTIVES:
        from . import collectives

        return getattr(collectives, name)
    if name == "is_dtensor":
        from .dtensor import is_dtensor

        return is_dtensor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
