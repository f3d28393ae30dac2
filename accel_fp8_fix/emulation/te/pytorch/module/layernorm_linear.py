"""Emulated ``transformer_engine.pytorch.LayerNormLinear`` (checked against TE 2.20.2
module/layernorm_linear.py): params ``layer_norm_weight``, ``layer_norm_bias`` (LayerNorm only),
``weight``, ``bias``. Norm in fp32, then the emulated (FP8) GEMM."""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple, Union

import torch

from .. import _numerics as N
from ..quantization import FP8GlobalStateManager
from .base import TransformerEngineBaseModule, get_default_init_method, init_method_constant
from .linear import _LinearCoreMixin
from .rmsnorm import rms_norm

__emulated__ = True


class LayerNormLinear(_LinearCoreMixin, TransformerEngineBaseModule):
    """Layer normalization on the input followed by a linear transformation (emulated)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        eps: float = 1e-5,
        sequence_parallel: bool = False,
        fuse_wgrad_accumulation: bool = False,
        tp_group=None,
        tp_size: int = 1,
        get_rng_state_tracker: Optional[Callable] = None,
        init_method: Optional[Callable] = None,
        bias: bool = True,
        normalization: str = "LayerNorm",
        return_bias: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        parallel_mode: Optional[str] = None,
        return_layernorm_output: bool = False,
        return_layernorm_output_gathered: bool = False,
        parameters_split: Optional[Union[Tuple[str, ...], Dict[str, int]]] = None,
        zero_centered_gamma: bool = False,
        device: Union[torch.device, str, None] = None,
        ub_overlap_ag: bool = False,
        ub_overlap_rs: bool = False,
        ub_overlap_rs_dgrad: bool = False,
        ub_bulk_wgrad: bool = False,
        ub_bulk_dgrad: bool = False,
        ub_name: Optional[str] = None,
        delay_wgrad_compute: bool = False,
        symmetric_ar_type: Optional[str] = None,
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
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        params_dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
        self.in_features = in_features
        self.out_features = out_features
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.normalization = normalization
        assert normalization in ["LayerNorm", "RMSNorm"], "Unsupported normalization type!"
        self.use_bias = bias
        self.return_bias = return_bias
        self.apply_bias = self.use_bias and not return_bias
        self.return_layernorm_output = return_layernorm_output
        self.return_layernorm_output_gathered = return_layernorm_output_gathered if return_layernorm_output else False
        self.zero_centered_gamma = zero_centered_gamma
        self.symmetric_ar_type = symmetric_ar_type
        self.eps = eps
        self.ub_name = ub_name
        if init_method is None:
            init_method = get_default_init_method()
        self._setup_tp(tp_group, tp_size, parallel_mode, sequence_parallel)

        ln_in = in_features  # the norm runs over the full hidden size (TE: in_features before division)
        self.register_parameter(
            "layer_norm_weight",
            torch.nn.Parameter(torch.empty(ln_in, device=device, dtype=params_dtype)),
            init_fn=init_method_constant(float(not self.zero_centered_gamma)),
        )
        if self.normalization != "RMSNorm":
            self.register_parameter(
                "layer_norm_bias",
                torch.nn.Parameter(torch.empty(ln_in, device=device, dtype=params_dtype)),
                init_fn=init_method_constant(0.0),
            )
        else:
            self.layer_norm_bias = None

        # parameters_split is rejected above: a single weight/bias (TE's default split).
        self.weight_names = ["weight"]
        self.bias_names = ["bias"]
        self.parameter_split_sizes = [self.out_features]  # TE: [out_features // tp_size] for column
        self.register_parameter(
            "weight",
            torch.nn.Parameter(torch.empty(self.out_features, self.in_features, device=device, dtype=params_dtype)),
            init_fn=init_method,
            get_rng_state_tracker=get_rng_state_tracker,
            fp8_meta_index=1,
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

        # For RPL, bias has to be added after TP collectives (TE 2.20.2; row mode is not emulated).
        self.gemm_bias_unfused_add = self.parallel_mode == "row" and self.apply_bias

    def reset_parameters(self, defer_init: Optional[bool] = False) -> None:
        super().reset_parameters(defer_init=defer_init)
        if not defer_init:
            setattr(self.layer_norm_weight, "sequence_parallel", self.sequence_parallel)
            if self.normalization != "RMSNorm":
                setattr(self.layer_norm_bias, "sequence_parallel", self.sequence_parallel)
            self._set_linear_parallel_attributes()

    def forward(
        self,
        inp: torch.Tensor,
        is_first_microbatch: Optional[bool] = None,
        fp8_output: Optional[bool] = False,
        fp8_grad: Optional[bool] = False,
    ):
        """Apply layer normalization to the input followed by a linear transformation."""
        inp = self.prepare_forward(inp, allow_non_contiguous=False)
        try:
            gamma = self.layer_norm_weight + 1 if self.zero_centered_gamma else self.layer_norm_weight
            if self.normalization == "RMSNorm":
                ln_out = rms_norm(inp, gamma, self.eps)
            else:
                ln_out = torch.nn.functional.layer_norm(
                    inp.float(), (inp.shape[-1],), gamma.float(), self.layer_norm_bias.float(), self.eps
                )
            ln_out = ln_out.to(self.activation_dtype)
            if self.parallel_mode == "row" and self.tp_size > 1:
                raise NotImplementedError("emulated LayerNormLinear: parallel_mode='row' is not emulated")
            out = self._gemm(ln_out, self.weight)
            res = self._finish(out, self.bias if self.use_bias else None)
            if self.return_layernorm_output:
                ln_ret = ln_out
                if self.return_layernorm_output_gathered and self.sequence_parallel:
                    ln_ret = N._all_gather_first(ln_out.detach(), self.tp_group)
                if isinstance(res, tuple):
                    return res[0], res[1], ln_ret
                return res, ln_ret
            return res
        finally:
            self.end_forward()
