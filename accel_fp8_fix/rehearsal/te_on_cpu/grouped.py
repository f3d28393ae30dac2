"""Grouped ops of the CPU stand-in for ``transformer_engine_torch`` (MoE experts: ``GroupedLinear``, ``Fp8Padding``).

Written from TE's sources (NVIDIA/TransformerEngine d0067d0, 2.20.0.dev0):

- ``split_quantize`` = ``pytorch/csrc/extensions/cast.cpp`` ``split_quantize``: split along dim 0, then one
  quantization per split with its own quantizer (``multi_tensor_quantize_impl``: the fused multi cast-transpose
  of delayed scaling computes per tensor what the single cast does); an empty split is allocated, not quantized
  (every ``Quantizer::quantize`` returns early on ``numel() == 0``). The fused NVFP4 split kernel is not modelled;
- ``te_general_grouped_gemm`` = ``pytorch/csrc/extensions/gemm.cpp`` ``te_general_grouped_gemm`` over
  ``nvte_multi_tensor_gemm`` (``common/gemm/cublaslt_gemm.cu``): one ``generic_gemm`` per group with the same
  flags, so a grouped GEMM equals E single GEMMs bit for bit; ``single_output`` packs the outputs back to back
  in ``D[0]``; a group with an empty operand zeroes its output (unless accumulating), its grad-bias and its
  pre-GELU output;
- ``fused_multi_row_padding`` / ``fused_multi_row_unpadding`` = ``extensions/padding.cpp`` over
  ``common/util/padding.cu``: copy each split's rows, zero the padding rows; empty splits are skipped;
- ``splits_to_offsets`` = ``extensions/misc.cpp`` (``nvte_splits_to_offsets``): [0, cumsum(splits * stride)].
"""

from __future__ import annotations

import math

import torch

from . import kernels as _kernels


def _dims(t) -> list:
    return list(t.shape) if isinstance(t, torch.Tensor) else list(t.size())


def _quantize_split(part: torch.Tensor, quantizer):
    if part.numel() == 0:  # Quantizer::quantize returns early: the output is only allocated
        return _kernels.create_empty_quantized_tensor(quantizer, list(part.shape), part.dtype, part.device, False)
    return _kernels.quantize(part, quantizer)


def split_quantize(tensor, split_sections, quantizer_list, disable_bulk_allocation=False):
    """Split ``tensor`` along dim 0 and quantize each split with its quantizer."""
    split_sections = [int(s) for s in split_sections]
    if len(quantizer_list) != len(split_sections):
        raise RuntimeError(f"Expected {len(split_sections)} quantizers, but got {len(quantizer_list)}")
    if not split_sections:
        return []
    x = tensor.contiguous()
    if x.dim() == 0:
        raise RuntimeError("Input tensor has 0 dims")
    if sum(split_sections) > x.shape[0]:
        raise RuntimeError(f"Attempted to split tensor with shape={list(x.shape)} along dim 0 with "
                           f"split_sections={split_sections}")
    kinds = {_kernels._quantizer_kind(q) for q in quantizer_list}
    if "NVFP4Quantizer" in kinds and kinds == {"NVFP4Quantizer"} and not disable_bulk_allocation:
        raise NotImplementedError("transformer_engine_torch.split_quantize with NVFP4 quantizers (the fused "
                                  "split_quantize_nvfp4_impl kernel): not implemented by the CPU rehearsal")
    _kernels._STATS["split_quantize"] += 1
    parts = torch.split(x[:sum(split_sections)], split_sections)
    return [_quantize_split(part, q) for part, q in zip(parts, quantizer_list)]


def multi_tensor_quantize(tensor_list, quantizer_list):
    """cast.cpp ``multi_tensor_quantize``: each tensor with its quantizer (same values as ``quantize``)."""
    if len(quantizer_list) != len(tensor_list):
        raise RuntimeError(f"Expected {len(tensor_list)} quantizers, but got {len(quantizer_list)}")
    for i, t in enumerate(tensor_list):
        if not t.is_contiguous():
            raise RuntimeError(f"Input tensor {i} is not contiguous")
    return [_quantize_split(t, q) for t, q in zip(tensor_list, quantizer_list)]


def gemm_output_shape(A, transa: bool, B, transb: bool) -> list:
    """gemm.cpp ``getGemmOutputShape`` (no comm overlap): [*B's outer dims or B1, A0 or A1]."""
    a_shape, b_shape = _dims(A), _dims(B)
    a0, a1 = math.prod(a_shape[:-1]), a_shape[-1]
    b0, b1 = math.prod(b_shape[:-1]), b_shape[-1]
    if (a1 if transa else a0) != (b0 if transb else b1):
        raise RuntimeError(f"Invalid matrix dimensions for GEMM (A=({a0},{a1}), transa={int(transa)}, "
                           f"B=({b0},{b1}), transb={int(transb)})")
    return [b1] if transb else b_shape[:-1] + [a0 if transa else a1]


def _output_views(A, transa, B, transb, D, D_type, single_output) -> list:
    """Each group's output: back-to-back views of ``D[0]`` (single output), ``D[i]``, or a new tensor."""
    shapes = [gemm_output_shape(a, transa, b, transb) for a, b in zip(A, B)]
    if not single_output:
        if D is not None:
            return list(D)
        return [torch.empty(shape, dtype=_kernels._torch_dtype(D_type)) for shape in shapes]
    flat = D[0].view(-1)  # the C++ walks a raw pointer through D[0]'s storage
    views, offset = [], 0
    for shape in shapes:
        numel = math.prod(shape)
        views.append(flat[offset:offset + numel].view(shape) if numel else torch.empty(shape, dtype=flat.dtype))
        offset += numel
    return views


def te_general_grouped_gemm(A, transa, B, transb, D, D_type, m_splits, bias, bias_type, single_output,
                            pre_gelu_out, grad, workspace, workspace_size, accumulate,
                            use_split_accumulator, math_sm_count=0):
    """``D[i] = op(B[i]) @ op(A[i])`` per group with ``generic_gemm``'s epilogues; returns ``bias`` (the grad-bias
    buffers are written in place when ``grad``). ``m_splits`` is not read, as in the C++."""
    if single_output and D is None:
        raise RuntimeError("not implemented, D should be allocated for single output case.")
    outputs = _output_views(A, transa, B, transb, D, D_type, single_output)
    _check_block_scaling_emulation(A, B)
    _kernels._STATS["grouped_gemms"] += 1
    for i, (a, b, out) in enumerate(zip(A, B, outputs)):
        with_gelu = pre_gelu_out[i].numel() != 0
        if math.prod(_dims(a)) == 0 or math.prod(_dims(b)) == 0:
            if out.numel() != 0 and not accumulate:
                out.zero_()
            if bias[i].numel() != 0 and grad:
                bias[i].zero_()
            if with_gelu:
                pre_gelu_out[i].zero_()
            continue
        bias_i = bias[i] if bias[i].numel() != 0 else None
        _, bias_grad, gelu_input, _ = _kernels.generic_gemm(
            a, transa, b, transb, out, None, D_type, bias_i, bias_type, with_gelu,
            pre_gelu_out[i] if grad and with_gelu else None, grad, workspace[0] if workspace else None,
            workspace_size, accumulate, use_split_accumulator)
        if grad and bias_i is not None:
            bias_i.copy_(bias_grad.reshape(bias_i.shape))
        if not grad and with_gelu:
            pre_gelu_out[i].copy_(gelu_input.reshape(pre_gelu_out[i].shape))
    return bias  # as the C++: outputs it allocated itself (D = None) are not returned


def _check_block_scaling_emulation(A, B) -> None:
    """gemm.cpp:579-594: on sm100 and newer, FP8 block scaling is emulated with MXFP8 for the whole grouped GEMM, so
    the operands of its non-empty groups are either all block-scaled or none is. (Each group's GEMM then applies
    ``generic_gemm``'s checks: scaling modes, cuBLASLt's FP8 leading dimensions, strided operands.)"""
    from . import cuda_as_cpu

    if cuda_as_cpu.capability() < (10, 0):
        return
    live = [t for a, b in zip(A, B) if math.prod(_dims(a)) and math.prod(_dims(b)) for t in (a, b)]
    blocks = [_kernels._scaling_mode(t) in _kernels._BLOCK_MODES for t in live]
    if any(blocks) and not all(blocks):
        raise RuntimeError("Either all tensors or no tensor must be FP8 block scaling tensors")


def _row_splits(t: torch.Tensor, rows: list) -> list:
    return list(torch.split(t[:sum(rows)], rows))


def _check_padding_args(input, output, input_rows, output_rows) -> None:
    if len(input_rows) != len(output_rows):
        raise RuntimeError("Number of input row list and padded row list must match.")
    if input.dim() != 2:
        raise RuntimeError("Dimension of input must equal 2.")
    if output.dim() != 2:
        raise RuntimeError("Dimension of output must equal  2.")


def fused_multi_row_padding(input, output, input_row_list, padded_input_row_list):
    """Split i's rows into the first rows of its padded block of ``output``, zeros below (padding.cu)."""
    rows, padded = [int(r) for r in input_row_list], [int(r) for r in padded_input_row_list]
    _check_padding_args(input, output, rows, padded)
    for src, dst, n in zip(_row_splits(input, rows), _row_splits(output, padded), rows):
        if n == 0:
            continue  # skipped by the C++: its padding rows are not written
        dst[:n].copy_(src)
        dst[n:].zero_()


def fused_multi_row_unpadding(input, output, input_row_list, unpadded_input_row_list):
    """The first ``unpadded`` rows of each padded split of ``input``, packed into ``output``."""
    rows, unpadded = [int(r) for r in input_row_list], [int(r) for r in unpadded_input_row_list]
    _check_padding_args(input, output, rows, unpadded)
    for src, dst, n in zip(_row_splits(input, rows), _row_splits(output, unpadded), rows):
        if n == 0:
            continue
        dst.copy_(src[:dst.shape[0]])


def splits_to_offsets(first_dims, logical_last_dim):
    """[0, cumsum(first_dims * logical_last_dim)] as int64 (misc.cpp / nvte_splits_to_offsets)."""
    if first_dims.dtype != torch.int64:
        raise RuntimeError("first_dims must have dtype int64.")
    if first_dims.dim() != 1:
        raise RuntimeError("first_dims must be a 1D tensor.")
    if logical_last_dim <= 0:
        raise RuntimeError("logical_last_dim must be greater than 0.")
    sums = torch.cumsum(first_dims.contiguous() * int(logical_last_dim), 0)
    return torch.cat([torch.zeros(1, dtype=torch.int64, device=first_dims.device), sums])
