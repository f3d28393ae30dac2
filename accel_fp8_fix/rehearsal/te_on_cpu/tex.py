"""CPU stand-in for ``transformer_engine_torch``, TE's C++/CUDA extension: the module TE imports.

``te_on_cpu.install()`` registers this module as ``sys.modules["transformer_engine_torch"]``. It is assembled
here from the kernels (``kernels.py``: casts, GEMMs, norms, activations, the amax-and-scale update; written from
TE's C++/CUDA sources) and the grouped ops (``grouped.py``: ``split_quantize``, the grouped GEMM, row padding),
which run on those kernels — so neither imports this module. Every other name TE 2.20's extension has is here too,
and raises ``NotImplementedError`` naming the op when called; a name the real extension does not have raises
``AttributeError`` (``REAL_EXTENSION_NAMES``), so ``hasattr(tex, name)`` answers as on a GPU. The extension's
functions run with CUDA-as-CPU's mode off (their torch calls are CPU arithmetic).

``ACCEL_FP8_FIX_REHEARSAL_FAST_ACCUM=1`` models Hopper's FP8 fast accumulation in the GEMMs TE runs with
``use_split_accumulator=False`` (``fast_accum_matmul``); ``ACCEL_FP8_FIX_REHEARSAL_TF32`` how TE's all-fp32 GEMMs
round their operands (TF32 on the device). Counters (``stats()``) count what ran: FP8 and high-precision GEMMs,
casts, scale updates.
"""

from __future__ import annotations

import sys
import types

from . import cuda_as_cpu, kernels
from .installed import te_version
from .kernels import *  # noqa: F401,F403  (the extension's kernels: this module's public names)
from .grouped import (  # noqa: E402
    fused_multi_row_padding,
    fused_multi_row_unpadding,
    multi_tensor_quantize,
    split_quantize,
    splits_to_offsets,
    te_general_grouped_gemm,
)

# --------------------------------------------------------------------------------------------------
# Everything else TE's extension has: a named NotImplementedError when called. Names it does not have:
# AttributeError, as the real module (``hasattr(tex, name)``, ``getattr(tex, name, default)`` answer as on a GPU).

# The module-level names of TE 2.20's ``transformer_engine_torch``: every ``m.def`` / ``py::class_`` / ``py::enum_``
# / ``def_submodule`` of ``pytorch/csrc/extensions/pybind.cpp``, ``extensions/ep.cpp`` and
# ``common/util/pybind_helper.h`` (NVIDIA/TransformerEngine main at 2.20.0.dev0, d0067d0, read 2026-12-01), plus
# the names TE 2.20.2's own Python reads from the extension (``tex.X``, ``from transformer_engine_torch import``;
# it adds ``NVTEScalingMode`` and ``ep_prepare_and_dispatch``). ``tex.LayerNorm``, read only by TE's ONNX export
# path, is in neither: the real extension has no such name.
REAL_EXTENSION_NAMES = frozenset((
    "CommOverlap", "CommOverlapAlgo", "CommOverlapBase", "CommOverlapCore", "CommOverlapHelper",
    "CommOverlapP2P", "CommOverlapP2PBase", "CommOverlapType", "DType", "FP8BwdTensors", "FP8FwdTensors",
    "FP8TensorMeta", "Float8BlockScaleTensorFormat", "NVTEQBHistogramMode", "NVTERoutingMapFormat",
    "NVTEScalingMode", "NVTE_Bias_Type", "NVTE_Fused_Attn_Backend", "NVTE_Mask_Type", "NVTE_QKV_Format",
    "NVTE_QKV_Layout", "NVTE_Softmax_Type", "bgrad_group_quantize", "bgrad_quantize", "bulk_allocate",
    "bulk_overlap_ag_with_external_gemm", "clamped_dswiglu", "clamped_swiglu", "compute_amax",
    "convert_bshd_to_thd", "convert_thd_to_bshd", "copy_data_ptrs_to_device", "copy_to_kv_cache",
    "create_empty_quantized_tensor", "create_nvshmem_tensor", "cusolvermp_ctx_create", "cusolvermp_ctx_destroy",
    "dbias_dgelu", "dbias_dqgelu", "dbias_drelu", "dbias_dsilu", "dbias_dsrelu", "dequantize",
    "device_supports_multicast", "dgeglu", "dgelu", "dglu", "dqgeglu", "dqgelu", "dreglu", "drelu",
    "dropout_bwd", "dropout_fwd", "dsilu", "dsituglu", "dsreglu", "dsrelu", "dswiglu", "ep_combine",
    "ep_combine_bwd", "ep_dispatch", "ep_dispatch_bwd", "ep_finalize", "ep_get_zero_copy", "ep_handle_mem_size",
    "ep_initialize", "ep_prepare", "ep_prepare_and_dispatch", "ep_zero_copy_supported", "fa_prepare_bwd",
    "fa_prepare_fwd", "fp8_block_scaling_compute_partial_amax", "fp8_block_scaling_partial_cast",
    "fp8_transpose", "fused_amax_and_scale_update_after_reduction", "fused_attn_bwd", "fused_attn_fwd",
    "fused_moe_aux_loss_bwd", "fused_moe_aux_loss_fwd", "fused_moe_aux_loss_fwd_graph_safe",
    "fused_multi_row_padding", "fused_multi_row_unpadding", "fused_qkv_rope_backward", "fused_qkv_rope_forward",
    "fused_rope_backward", "fused_rope_forward", "fused_score_for_moe_aux_loss_bwd",
    "fused_score_for_moe_aux_loss_fwd", "fused_topk_with_score_function_bwd",
    "fused_topk_with_score_function_fwd", "fused_topk_with_score_function_qb_fwd", "geglu", "gelu",
    "generic_gemm", "get_cublasLt_version", "get_cudnn_version", "get_fused_attn_backend",
    "get_grouped_gemm_setup_workspace_size", "get_num_cublas_streams", "get_stream_priority_range", "glu",
    "group_dequantize", "group_quantize", "group_requantize_inplace", "grouped_mlp_experimental",
    "grouped_swizzle_for_gemm", "init_nvshmem_backend", "layernorm_bwd", "layernorm_fwd", "moe_permute_bwd",
    "moe_permute_fwd", "moe_unpermute_bwd", "moe_unpermute_fwd", "multi_tensor_adam",
    "multi_tensor_adam_capturable", "multi_tensor_adam_capturable_master", "multi_tensor_adam_fp8",
    "multi_tensor_adam_param_remainder", "multi_tensor_compute_scale_and_scale_inv",
    "multi_tensor_compute_scale_inv_e8m0", "multi_tensor_l2norm", "multi_tensor_pad_last_dim",
    "multi_tensor_quantize", "multi_tensor_scale", "multi_tensor_scale_tensor", "multi_tensor_sgd",
    "multi_tensor_swizzle_scales_for_gemm_", "multi_tensor_swizzle_scales_for_gemm_unchecked_",
    "multi_tensor_transpose_to_bhsd", "multi_tensor_unscale_l2norm", "mxfp8_scaling_compute_partial_amax",
    "mxfp8_scaling_partial_cast", "newton_schulz", "nvfp4_2d_compute_partial_amax",
    "nvfp4_2d_multi_tensor_transpose", "nvfp4_2d_partial_cast", "nvfp4_2d_scale_transpose",
    "nvfp4_compute_global_scale", "nvfp4_compute_per_block_scale", "nvfp4_data_transpose",
    "nvfp4_expand_scale_to_fp8", "nvfp4_fused_scale", "nvfp4_group_quantize_with_amax",
    "nvfp4_multi_tensor_2d_partial_cast", "nvfp4_multi_tensor_compute_partial_amax",
    "nvfp4_multi_tensor_fused_scale", "nvfp4_quantize_with_amax", "nvshmem_finalize",
    "nvshmem_send_on_current_stream", "nvshmem_wait_on_current_stream", "nvte_built_with_cublasmp", "qgeglu",
    "qgelu", "quantize", "reglu", "relu", "rmsnorm_bwd", "rmsnorm_bwd_add", "rmsnorm_fwd",
    "scaled_aligned_causal_masked_softmax_backward", "scaled_aligned_causal_masked_softmax_forward",
    "scaled_clamped_dswiglu", "scaled_clamped_swiglu", "scaled_dsituglu", "scaled_dsrelu", "scaled_dswiglu",
    "scaled_masked_softmax_backward", "scaled_masked_softmax_forward", "scaled_situglu",
    "scaled_softmax_backward", "scaled_softmax_forward", "scaled_srelu", "scaled_swiglu",
    "scaled_upper_triang_masked_softmax_backward", "scaled_upper_triang_masked_softmax_forward", "silu",
    "situglu", "split_quantize", "splits_to_offsets", "splits_to_offsets_multi", "sreglu", "srelu",
    "swap_first_dims", "swiglu", "swizzle_scales_for_gemm_", "te_general_grouped_gemm",
    "te_general_grouped_gemm_for_discrete_in", "te_general_grouped_gemm_for_discrete_out",
    "te_general_grouped_gemm_for_grouped_tensor", "thd_copy_valid_tokens_from_per_split_to_rank_local",
    "thd_cp_rank_order_to_sequence_order", "thd_get_partitioned_indices", "thd_grad_correction",
    "thd_out_correction", "thd_read_half_tensor", "thd_read_second_half_lse", "thd_second_half_lse_correction",
    "thd_sequence_order_to_cp_rank_order", "ubuf_built_with_mpi",
))
_SUBMODULES = frozenset({"grouped_mlp_experimental"})
_extension_names: dict = {}


def _installed_te_names() -> frozenset:
    """REAL_EXTENSION_NAMES, widened for another TE release by the names its Python reads from the extension."""
    if "names" not in _extension_names:
        names = set(REAL_EXTENSION_NAMES)
        installed = te_version() or ""
        if not installed.startswith("2.20."):
            names |= _names_read_by_te_python()
        _extension_names["names"] = frozenset(names)
    return _extension_names["names"]


def _names_read_by_te_python() -> set:
    import importlib.util
    import pathlib
    import re

    spec = importlib.util.find_spec("transformer_engine")
    if spec is None or not spec.submodule_search_locations:
        return set()
    found = set()
    for root in spec.submodule_search_locations:
        for path in pathlib.Path(root, "pytorch").rglob("*.py"):
            text = path.read_text(errors="replace")
            if "transformer_engine_torch" not in text:
                continue
            found |= set(re.findall(r"(?<!ops\.)\btex\.([A-Za-z_]\w*)", text))
            found |= set(re.findall(r"transformer_engine_torch\.([A-Za-z_]\w*)", text))
            for group in re.findall(r"from transformer_engine_torch import\s*(\([^)]*\)|[^\n]*)", text):
                found |= set(re.findall(r"[A-Za-z_]\w*", re.sub(r"#[^\n]*", "", group))) - {"import", "as"}
    return found


def _not_implemented(name: str):
    def not_implemented(*args, **kwargs):
        raise NotImplementedError(
            f"transformer_engine_torch.{name}: not implemented by the CPU rehearsal of Transformer "
            "Engine (accel_fp8_fix.rehearsal.te_on_cpu); it covers Linear, LayerNormLinear, "
            "LayerNormMLP, LayerNorm, RMSNorm and GroupedLinear (discrete weights) under TE's recipes (delayed / current scaling, MXFP8, FP8 "
            "block scaling, NVFP4)"
        )

    not_implemented.__name__ = name
    return not_implemented


class _NotImplementedSubmodule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _not_implemented(f"{self.__name__.split('.', 1)[-1]}.{name}")


def __getattr__(name: str):
    if not name.startswith("__") and hasattr(kernels, name):  # the kernels' own helpers (tex._STATS, ...)
        return getattr(kernels, name)
    if name.startswith("__") or name not in _installed_te_names():
        raise AttributeError(f"module 'transformer_engine_torch' has no attribute {name!r}")
    if name in _SUBMODULES:
        return _NotImplementedSubmodule(f"transformer_engine_torch.{name}")
    if name[:1].isupper():
        return type(name, (kernels._NotOnCpu,), {})
    return _not_implemented(name)


def _kernels_run_with_the_mode_off() -> None:
    """The extension's functions defined here run without CUDA-as-CPU's mode (cuda_as_cpu.mode_off): their torch
    calls are CPU arithmetic, so the mode has nothing to map and would only cost a Python call for each."""
    module = vars(sys.modules[__name__])
    for name in REAL_EXTENSION_NAMES:
        value = module.get(name)
        if isinstance(value, types.FunctionType):
            module[name] = cuda_as_cpu.mode_off(value)


_kernels_run_with_the_mode_off()
