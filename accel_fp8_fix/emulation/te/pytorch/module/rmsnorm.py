"""Emulated ``transformer_engine.pytorch.RMSNorm`` (checked against TE 2.20.2 module/rmsnorm.py and
ops/basic/rmsnorm.py: one parameter, ``weight``)."""

from __future__ import annotations

import torch

from .layernorm import _NormBase

__emulated__ = True


def rms_norm(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * gamma.float()


class RMSNorm(_NormBase):
    """Root-mean-square normalization (emulated TE RMSNorm)."""

    _has_bias = False

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        self._reject(inp)
        return rms_norm(inp, self._gamma(), self.eps).to(inp.dtype)
