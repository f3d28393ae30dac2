"""The suite's toy models, in plain torch: pre-norm MLP blocks (``Block``, the FSDP2 wrap unit found by class name)
stacked with a head (``BlockStack``). Module-level classes, so FSDP2's wrap policy, pickling and the GPU tests all
see one ``Block``; imported where torch is (inside the ranks, the GPU tests, the benchmarks)."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    """``x + fc2(gelu(fc1(norm(x))))``; ``norm=False``: no LayerNorm; ``bias=False``: bias-free Linears."""

    def __init__(self, dim: int, hidden: int, norm: bool = True, bias: bool = True):
        super().__init__()
        self.norm = nn.LayerNorm(dim) if norm else None
        self.fc1 = nn.Linear(dim, hidden, bias=bias)
        self.fc2 = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x if self.norm is None else self.norm(x))))


class BlockStack(nn.Module):
    """``depth`` Blocks and a Linear head to ``out``; ``buffer=True`` scales the input by a persistent plain buffer
    ``scale`` (it is in ``state_dict()``)."""

    def __init__(self, dim: int, hidden: int, depth: int, out: int, buffer: bool = False, norm: bool = True,
                 bias: bool = True):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, hidden, norm=norm, bias=bias) for _ in range(depth))
        self.head = nn.Linear(dim, out, bias=bias)
        if buffer:
            self.register_buffer("scale", torch.full((dim,), 0.5))
        else:
            self.scale = None

    def forward(self, x):
        if self.scale is not None:
            x = x * self.scale
        for block in self.blocks:
            x = block(x)
        return self.head(x)
