"""Emulated ``transformer_engine.pytorch.Linear`` (checked against TE 2.20.2 pytorch/module/linear.py).

Same constructor keywords and attributes; TE-native TP on plain local shards (column: out_features
divided; row: in_features divided, output all-reduced / reduce-scattered over ``tp_group`` and the
bias added after the reduction). FP8 is emulated (quantize -> dequantize -> fp32 GEMM).
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple, Union

import torch

from .. import _numerics as N
from ..quantization import FP8GlobalStateManager, _has_delayed_scaling_state
from .base import TransformerEngineBaseModule, init_method_constant

__emulated__ = True

GemmParallelModes = ("row", "column", None)


def divide(numerator: int, denominator: int) -> int:
    assert numerator % denominator == 0, f"{numerator} is not divisible by {denominator}"
    return numerator // denominator


# TE 2.20.2 pytorch/distributed.py (kept here: the emulation has no ``pytorch.distributed`` module).
_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS = {
    "tensor_model_parallel": False,
    "partition_dim": -1,
    "partition_stride": 1,
}


def set_tensor_model_parallel_attributes(tensor: torch.Tensor, is_parallel: bool, dim: int, stride: int) -> None:
    """set attributes needed for TP"""
    for attribute in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS:
        if hasattr(tensor, attribute):
            raise RuntimeError(
                f"Tensor already has attribute '{attribute}' set. Cannot set "
                "tensor model parallel attributes on a tensor that already has them."
            )
    setattr(tensor, "tensor_model_parallel", is_parallel)
    setattr(tensor, "partition_dim", dim)
    setattr(tensor, "partition_stride", stride)


def _group_size(group) -> int:
    import torch.distributed as dist

    return dist.get_world_size(group)


class _LinearCoreMixin:
    """TP setup and the FP8/high-precision GEMM path shared by Linear and LayerNormLinear."""

    def _setup_tp(self, tp_group, tp_size: int, parallel_mode, sequence_parallel: bool) -> None:
        if tp_group is None:
            self.tp_size = tp_size
            if tp_size == 1:
                self.set_tensor_parallel_group(tp_group)
        else:
            self.tp_size = _group_size(tp_group)
            self.set_tensor_parallel_group(tp_group)
        self.parallel_mode = parallel_mode
        assert self.parallel_mode in GemmParallelModes, f"parallel_mode {parallel_mode} not supported"
        if self.parallel_mode == "column":
            self.out_features = divide(self.out_features, self.tp_size)
        elif self.parallel_mode == "row":
            self.in_features = divide(self.in_features, self.tp_size)
        self.sequence_parallel = (self.tp_size > 1) and sequence_parallel

    def _set_linear_parallel_attributes(self) -> None:
        """The tail of TE's ``Linear.reset_parameters`` / ``LayerNormLinear.reset_parameters`` (not
        deferred): TP attributes on every weight (always, even with ``tp_size == 1``;
        ``partition_dim`` 1 for row, 0 otherwise), ``sequence_parallel`` on row-parallel biases, TP
        attributes on column-parallel biases."""
        for weight in self.weight_names:
            set_tensor_model_parallel_attributes(
                tensor=getattr(self, weight),
                is_parallel=True,
                dim=1 if self.parallel_mode == "row" else 0,
                stride=1,
            )
        if self.use_bias:
            for bias in self.bias_names:
                if self.parallel_mode == "row":
                    setattr(getattr(self, bias), "sequence_parallel", self.sequence_parallel)
                elif self.parallel_mode == "column":
                    set_tensor_model_parallel_attributes(getattr(self, bias), True, 0, 1)

    @staticmethod
    def _reject_unemulated(**flags) -> None:
        on = [k for k, v in flags.items() if v]
        if on:
            raise NotImplementedError(
                f"emulated transformer_engine: {', '.join(on)} not emulated (no userbuffers / "
                "delayed wgrad on CPU)"
            )

    def _emulation_label(self) -> str:
        return f"{type(self).__name__}(in={self.in_features},out={self.out_features})"

    def _gemm(self, inp: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Local GEMM of ``inp`` [..., in_local] with ``weight`` [out_local, in_local] (+ TP comms
        around it that do not involve the bias)."""
        group = self.tp_group
        if self.tp_size > 1 and self.parallel_mode == "column":
            inp = N.gather_along_first_dim(inp, group) if self.sequence_parallel else N.copy_to_tensor_parallel(inp, group)
        lead = inp.shape[:-1]
        x2d = inp.reshape(-1, inp.shape[-1])
        fp8 = self.fp8
        q_in = q_w = q_grad = None
        reduce_bwd = False
        mx = False
        if fp8:
            q_in, q_w = self.quantizers["scaling_fwd"][0], self.quantizers["scaling_fwd"][1]
            q_grad = self.quantizers["scaling_bwd"][0]
            mx = self.fp8_meta["recipe"].mxfp8()
            if _has_delayed_scaling_state(self.fp8_meta):
                reduce_bwd = FP8GlobalStateManager.is_first_fp8_module()
        out = N._EmulatedLinearGemm.apply(
            x2d, weight, self, fp8, q_in, q_w, q_grad, self.activation_dtype, reduce_bwd, mx
        )
        out = out.view(*lead, out.shape[-1])
        if self.tp_size > 1 and self.parallel_mode == "row":
            out = N.reduce_scatter_along_first_dim(out, group) if self.sequence_parallel else N.reduce_from_tensor_parallel(out, group)
        return out

    def _finish(self, out: torch.Tensor, bias: Optional[torch.Tensor]):
        if bias is not None and bias.numel() == 0:
            bias = None
        if self.apply_bias and bias is not None:
            out = out + bias.to(out.dtype)
        if self.return_bias:
            return out, (bias.to(self.activation_dtype) if bias is not None else None)
        return out


class Linear(_LinearCoreMixin, TransformerEngineBaseModule):
    """Applies a linear transformation ``y = x A^T + b`` (emulated TE Linear; not an nn.Linear)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        sequence_parallel: bool = False,
        fuse_wgrad_accumulation: bool = False,
        tp_group=None,
        tp_size: int = 1,
        get_rng_state_tracker: Optional[Callable] = None,
        rng_tracker_name: Optional[str] = None,
        init_method: Optional[Callable] = None,
        bias: bool = True,
        return_bias: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        parallel_mode: Optional[str] = None,
        parameters_split: Optional[Union[Tuple[str, ...], Dict[str, int]]] = None,
        device: Union[torch.device, str, None] = None,
        ub_overlap_ag: bool = False,
        ub_overlap_rs: bool = False,
        ub_overlap_rs_dgrad: bool = False,
        ub_bulk_dgrad: bool = False,
        ub_bulk_wgrad: bool = False,
        ub_name: Optional[str] = None,
        delay_wgrad_compute: bool = False,
        symmetric_ar_type: Optional[str] = None,
        save_original_input: bool = False,
        name: Optional[str] = None,
    ) -> None:
        super().__init__(name)
        self._reject_unemulated(
            parameters_split=parameters_split is not None,
            ub_overlap_ag=ub_overlap_ag,
            ub_overlap_rs=ub_overlap_rs,
            ub_overlap_rs_dgrad=ub_overlap_rs_dgrad,
            ub_bulk_dgrad=ub_bulk_dgrad,
            ub_bulk_wgrad=ub_bulk_wgrad,
            delay_wgrad_compute=delay_wgrad_compute,
        )
        # TE's default device is "cuda"; the emulation defaults to CUDA only when there is one.
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        params_dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
        self.in_features = in_features
        self.out_features = out_features
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.use_bias = bias
        self.return_bias = return_bias
        self.apply_bias = bias and not return_bias
        self.get_rng_state_tracker = get_rng_state_tracker
        self.rng_tracker_name = rng_tracker_name
        self.symmetric_ar_type = symmetric_ar_type
        self.save_original_input = save_original_input
        self.ub_name = ub_name
        self._setup_tp(tp_group, tp_size, parallel_mode, sequence_parallel)

        weight_tensor = torch.empty(self.out_features, self.in_features, device=device, dtype=params_dtype)
        self.weight_names = ["weight"]
        self.bias_names = ["bias"]
        self.parameter_split_sizes = [self.out_features]
        self.register_parameter(
            "weight",
            torch.nn.Parameter(weight_tensor),
            init_fn=init_method,
            get_rng_state_tracker=get_rng_state_tracker,
            fp8_meta_index=1,  # FP8FwdTensorIdx.GEMM1_WEIGHT
        )
        if self.use_bias:
            self.register_parameter(
                "bias",
                torch.nn.Parameter(torch.empty(self.out_features, device=device, dtype=params_dtype)),
                init_fn=init_method_constant(0.0),
            )
        else:
            self.bias = torch.Tensor().to(dtype=params_dtype, device=device)

        if FP8GlobalStateManager.with_fp8_parameters():
            self.init_fp8_metadata()

        self.reset_parameters(defer_init=torch.device(device).type == "meta")
        self.gemm_bias_unfused_add = self.parallel_mode == "row" and self.apply_bias

    def reset_parameters(self, defer_init: Optional[bool] = False) -> None:
        super().reset_parameters(defer_init=defer_init)
        if not defer_init:
            self._set_linear_parallel_attributes()

    def forward(
        self,
        inp: torch.Tensor,
        is_first_microbatch: Optional[bool] = None,
        fp8_output: Optional[bool] = False,
        fp8_grad: Optional[bool] = False,
    ):
        """Apply the linear transformation to the input."""
        inp = self.prepare_forward(inp, allow_non_contiguous=False)
        try:
            out = self._gemm(inp, self.weight)
            return self._finish(out, self.bias if self.use_bias else None)
        finally:
            self.end_forward()
