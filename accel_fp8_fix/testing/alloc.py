"""``LargestAllocation``: the largest tensor any op produced inside the block (a dispatch-level probe used
to prove that conversion after sharding never materialises a full-size weight)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LargestAllocation(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.numel = 0
        self.op = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # Views and in-place ops (detach, chunk, narrow, copy_, ...) return an alias of an input: no allocation.
        if any(r.alias_info is not None for r in func._schema.returns):
            return out
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.numel() > self.numel:
                self.numel, self.op = t.numel(), str(func)
        return out
