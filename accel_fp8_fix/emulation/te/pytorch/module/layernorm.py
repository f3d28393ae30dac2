"""Emulated ``transformer_engine.pytorch.LayerNorm`` (checked against TE 2.20.2 module/layernorm.py,
which subclasses the fusible op ``ops.LayerNorm``, not TransformerEngineBaseModule)."""

from __future__ import annotations

import warnings
from typing import Iterable, Optional, Union

import torch

__emulated__ = True


def _canonical_device(device):
    if device is None:
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    return torch.device(device)


class _NormBase(torch.nn.Module):
    _has_bias = True

    def __init__(
        self,
        normalized_shape: Union[Iterable[int], int, None] = None,
        eps: float = 1e-5,
        sequence_parallel: Optional[bool] = None,
        params_dtype: Optional[torch.dtype] = None,
        zero_centered_gamma: bool = False,
        hidden_size: Optional[int] = None,
        **kwargs,
    ) -> None:
        if normalized_shape is None:
            if hidden_size is None:
                raise RuntimeError("Neither `normalized_shape` nor `hidden_size` (deprecated) args are provided")
            warnings.warn(
                "`hidden_size` arg has been renamed to `normalized_shape` for compatibility with `torch.nn.LayerNorm`.",
                DeprecationWarning,
                stacklevel=2,
            )
            normalized_shape = hidden_size
        elif hidden_size is not None:
            raise RuntimeError("Both `normalized_shape` and `hidden_size` (deprecated) args are provided")
        if params_dtype is not None:
            if "dtype" in kwargs:
                raise RuntimeError("Both `dtype` and `params_dtype` (deprecated) kwargs are provided")
            kwargs["dtype"] = params_dtype
        self.sequence_parallel: Optional[bool] = sequence_parallel
        self._op_init(normalized_shape, eps=eps, zero_centered_gamma=zero_centered_gamma, **kwargs)

    # signature of TE's ops.LayerNorm / ops.RMSNorm __init__ (keyword-only tail)
    def _op_init(self, normalized_shape, *, eps: float = 1e-5, device=None, dtype=None, zero_centered_gamma: bool = False, sm_margin=0) -> None:
        super().__init__()
        self.eps = eps
        self.zero_centered_gamma = zero_centered_gamma
        if not isinstance(normalized_shape, Iterable):
            normalized_shape = (normalized_shape,)
        self.normalized_shape = tuple(normalized_shape)
        device = _canonical_device(device)
        dtype = torch.get_default_dtype() if dtype is None else dtype
        self.register_parameter("weight", torch.nn.Parameter(torch.empty(self.normalized_shape, device=device, dtype=dtype)))
        if self._has_bias:
            self.register_parameter("bias", torch.nn.Parameter(torch.empty(self.normalized_shape, device=device, dtype=dtype)))
        self._sm_margins = {"forward": 0, "backward": 0, "inference": 0} if not isinstance(sm_margin, dict) else dict(sm_margin)
        if device.type != "meta":
            self.reset_parameters()

    def fast_setattr(self, name, value) -> None:
        self.__dict__[name] = value

    def reset_parameters(self, defer_init: Optional[bool] = None) -> None:
        if defer_init:
            return
        dev = self.weight.device
        if dev.type == "meta":
            dev = _canonical_device(None)
        w = torch.empty_like(self.weight, device=dev)
        with torch.no_grad():
            (torch.nn.init.zeros_ if self.zero_centered_gamma else torch.nn.init.ones_)(w)
        self.weight = torch.nn.Parameter(w)
        if self._has_bias:
            b = torch.zeros_like(self.bias, device=dev)
            self.bias = torch.nn.Parameter(b)
        if self.sequence_parallel is not None:
            self.weight.sequence_parallel = self.sequence_parallel
            if self._has_bias:
                self.bias.sequence_parallel = self.sequence_parallel

    def _gamma(self):
        return self.weight + 1 if self.zero_centered_gamma else self.weight

    def _reject(self, inp):
        from .base import _is_dtensor

        label = f"{type(self).__name__}({self.normalized_shape})"
        if _is_dtensor(inp):
            raise TypeError(f"emulated transformer_engine {label}: the input is a DTensor; TE kernels take local tensors")
        for name, p in self.named_parameters(recurse=False):
            if _is_dtensor(p):
                raise TypeError(f"emulated transformer_engine {label}: {name} is a DTensor; TE kernels take local tensors")


class LayerNorm(_NormBase):
    """Layer normalization (emulated TE LayerNorm; params ``weight``, ``bias``)."""

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        self._reject(inp)
        dtype = inp.dtype
        y = torch.nn.functional.layer_norm(
            inp.float(), self.normalized_shape, self._gamma().float(), self.bias.float(), self.eps
        )
        return y.to(dtype)
