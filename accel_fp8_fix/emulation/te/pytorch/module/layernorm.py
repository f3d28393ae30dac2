"""Emulated ``transformer_engine.pytorch.LayerNorm`` (checked against TE 2.20.2 module/layernorm.py,
which subclasses the fusible op ``ops.LayerNorm``, not TransformerEngineBaseModule).

Like TE's op: no ``normalized_shape`` attribute (TE keeps the shape only as the parameters' shape;
the forward normalizes over ``weight.shape``), and ``get_extra_state`` / ``set_extra_state`` of
``ops.op.BasicOperation`` (a norm op has no quantizers, so its ``_extra_state`` is always an empty
uint8 tensor)."""

from __future__ import annotations

import pickle
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
        else:
            normalized_shape = tuple(normalized_shape)
        device = _canonical_device(device)
        dtype = torch.get_default_dtype() if dtype is None else dtype
        self.register_parameter("weight", torch.nn.Parameter(torch.empty(normalized_shape, device=device, dtype=dtype)))
        if self._has_bias:
            self.register_parameter("bias", torch.nn.Parameter(torch.empty(normalized_shape, device=device, dtype=dtype)))
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

    # ---------------------------------------------------------------- extra state (ops.op.BasicOperation)
    def get_extra_state(self) -> torch.Tensor:
        """Serialize extra state: TE's ``BasicOperation.get_extra_state`` pickles only quantizer state
        (per mode, stateful recipes only). A norm op has no quantizers (``num_quantizers() == 0``),
        so this is always ``torch.empty(0, dtype=torch.uint8)`` on CPU."""
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state: Optional[torch.Tensor]) -> None:
        """Load extra state (TE's ``BasicOperation.set_extra_state``): ``None`` or an empty tensor is
        ignored; a pickle without quantizer state too. Quantizer state cannot be loaded into a norm
        (no quantizers; TE fails there as well)."""
        if state is None or state.numel() == 0:
            return
        state = pickle.loads(state.detach().cpu().numpy().tobytes())
        if state is None or len(state) == 0:
            return
        modes = [m for m in ("forward", "backward") if m in state]
        if modes:
            raise RuntimeError(
                f"emulated transformer_engine {type(self).__name__}: checkpoint has {'/'.join(modes)} "
                "quantizer state, but a normalization op has no quantizers"
            )

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        """As TE's ``BasicOperation``: load the extra state before the parameters."""
        state_dict, prefix = args[0], args[1]
        extra_state_key = prefix + torch.nn.modules.module._EXTRA_STATE_KEY_SUFFIX
        if extra_state_key in state_dict:
            self.set_extra_state(state_dict[extra_state_key])
        super()._load_from_state_dict(*args, **kwargs)

    def _gamma(self):
        return self.weight + 1 if self.zero_centered_gamma else self.weight

    def _reject(self, inp):
        from .base import _is_dtensor

        label = f"{type(self).__name__}({tuple(self.weight.shape)})"
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
            inp.float(), tuple(self.weight.shape), self._gamma().float(), self.bias.float(), self.eps
        )
        return y.to(dtype)
