"""The CPU kernels of the stand-in for ``transformer_engine_torch``, TE's C++/CUDA extension (``tex.py`` assembles
the module TE imports from these, ``grouped.py``'s and the names TE's extension has that the rehearsal does not run).

Everything above the kernels is TE's own Python. The kernels supply the ops that
``Linear``, ``LayerNormLinear``, ``LayerNormMLP``, ``LayerNorm``, ``RMSNorm`` and ``GroupedLinear`` (discrete weights;
grouped ops in ``grouped.py``) call for every recipe of
TE 2.20 — ``DelayedScaling``, ``Float8CurrentScaling``, ``MXFP8BlockScaling``, ``Float8BlockScaling``,
``NVFP4BlockScaling`` — written from TE's C++/CUDA sources (``pytorch/csrc/extensions/*.cpp``,
``pytorch/csrc/quantizer.cpp``, ``common/recipe/*.cu``, ``common/transpose/*blockwise*.cu``,
``common/cast/nvfp4/*.cuh``):

- FP8 cast = ``cvt.rn.satfinite``: round to nearest even, saturate to ±448 (E4M3) / ±57344 (E5M2),
  NaN stays NaN; the cast kernel max-accumulates the tensor's amax into the delayed-scaling amax;
- block-scaled FP8 and NVFP4 casts write TE's storage layouts (``Float8BlockwiseQTensor``: FP32 scales per
  1x128 block or 128x128 tile, GEMM_READY; ``NVFP4Tensor``: packed E2M1, E4M3 scales per 16 values, compact,
  FP32 per-tensor amax; random Hadamard transform, 2-D tiles and stochastic rounding as TE's options);
- ``generic_gemm`` = dequantize → fp32 matmul → bias / GELU epilogues → output dtype: a reference GEMM
  (for block scaling and NVFP4 too: the operands' exact dequantized values, fp32 accumulation, not
  cuBLAS' accumulation order); an FP8 operand must carry the usage the layout needs (row-wise data for
  ``transa``, the transpose otherwise on Hopper / for block scaling and NVFP4), as cuBLAS requires;
- ``fused_amax_and_scale_update_after_reduction`` = ``delayed_scaling.cu``'s ``kernel_bulk``;
- norms in fp32 with fused quantization of the output.

Ops this stand-in does not implement raise ``NotImplementedError`` naming the op when called; a name the
real TE 2.20 extension does not have raises ``AttributeError`` (``REAL_EXTENSION_NAMES``). The answers that
are not kernels (versions from ``target.py``, swizzle no-ops, ``get_fused_attn_backend``, ignored
arguments) are listed by name in docs/rehearsal.md, "GPU-shaped answers". Enums mirror TE's C++ headers
value for value.

``ACCEL_FP8_FIX_REHEARSAL_FAST_ACCUM=1`` models Hopper's FP8 fast accumulation in the GEMMs TE runs with
``use_split_accumulator=False`` (``fast_accum_matmul``); by default every GEMM accumulates exactly in fp32, an
all-fp32 GEMM on TF32-rounded operands as TE's on the device (``ACCEL_FP8_FIX_REHEARSAL_TF32``, ``round_to_tf32``).

Counters (``stats()``) count what ran: FP8 and high-precision GEMMs, casts, scale updates.
"""

from __future__ import annotations

import enum
import functools
import math
import os
import sys
import types
from collections import Counter

import torch

from . import cuda_as_cpu, target

# --------------------------------------------------------------------------------------------------
# Enums (values from common/include/transformer_engine/*.h and pytorch/csrc/common.h)


class DType(enum.IntEnum):
    kByte = 0
    kInt32 = 2
    kFloat32 = 4
    kFloat16 = 5
    kBFloat16 = 6
    kFloat8E4M3 = 7
    kFloat8E5M2 = 8
    kFloat4E2M1 = 10


class FP8FwdTensors(enum.IntEnum):
    GEMM1_INPUT = 0
    GEMM1_WEIGHT = 1
    GEMM1_OUTPUT = 2
    GEMM2_INPUT = 3
    GEMM2_WEIGHT = 4
    GEMM2_OUTPUT = 5
    GEMM3_INPUT = 6
    GEMM3_WEIGHT = 7
    GEMM3_OUTPUT = 8


class FP8BwdTensors(enum.IntEnum):
    GRAD_OUTPUT1 = 0
    GRAD_INPUT1 = 1
    GRAD_OUTPUT2 = 2
    GRAD_INPUT2 = 3
    GRAD_OUTPUT3 = 4
    GRAD_INPUT3 = 5


class NVTEScalingMode(enum.IntEnum):
    NVTE_DELAYED_TENSOR_SCALING = 0
    NVTE_MXFP8_1D_SCALING = 1
    NVTE_BLOCK_SCALING_1D = 2
    NVTE_BLOCK_SCALING_2D = 3
    NVTE_NVFP4_1D_SCALING = 4
    NVTE_INVALID_SCALING = 100


def _te_before(version: str) -> bool:
    from packaging.version import Version

    from .installed import te_version

    installed = te_version()
    return installed is not None and Version(installed) < Version(version)


# TE checks at import that its Python enum has exactly the extension's members; max512 left in 2.16.
NVTE_Fused_Attn_Backend = enum.IntEnum("NVTE_Fused_Attn_Backend", {
    "NVTE_No_Backend": -1,
    **({"NVTE_F16_max512_seqlen": 0} if _te_before("2.16") else {}),
    "NVTE_F16_arbitrary_seqlen": 1,
    "NVTE_FP8": 2,
})


class NVTE_Bias_Type(enum.IntEnum):
    NVTE_NO_BIAS = 0
    NVTE_PRE_SCALE_BIAS = 1
    NVTE_POST_SCALE_BIAS = 2
    NVTE_ALIBI = 3


class NVTE_Mask_Type(enum.IntEnum):
    NVTE_NO_MASK = 0
    NVTE_PADDING_MASK = 1
    NVTE_CAUSAL_MASK = 2
    NVTE_PADDING_CAUSAL_MASK = 3
    NVTE_CAUSAL_BOTTOM_RIGHT_MASK = 4
    NVTE_PADDING_CAUSAL_BOTTOM_RIGHT_MASK = 5


class NVTE_Softmax_Type(enum.IntEnum):
    NVTE_VANILLA_SOFTMAX = 0
    NVTE_OFF_BY_ONE_SOFTMAX = 1
    NVTE_LEARNABLE_SOFTMAX = 2


class NVTE_QKV_Format(enum.IntEnum):
    NVTE_SBHD = 0
    NVTE_BSHD = 1
    NVTE_THD = 2
    NVTE_BSHD_2SBHD = 3
    NVTE_SBHD_2BSHD = 4
    NVTE_THD_2BSHD = 5
    NVTE_THD_2SBHD = 6
    NVTE_BHSD = 7
    NVTE_QKV_Format_NOT_SET = 8


_QKV_LAYOUTS = (
    "SB3HD SBH3D SBHD_SB2HD SBHD_SBH2D SBHD_SBHD_SBHD BS3HD BSH3D BSHD_BS2HD BSHD_BSH2D "
    "BSHD_BSHD_BSHD T3HD TH3D THD_T2HD THD_TH2D THD_THD_THD SBHD_BSHD_BSHD BSHD_SBHD_SBHD "
    "THD_BSHD_BSHD THD_SBHD_SBHD Paged_KV_BSHD_BSHD_BSHD Paged_KV_BSHD_SBHD_SBHD "
    "Paged_KV_SBHD_BSHD_BSHD Paged_KV_SBHD_SBHD_SBHD Paged_KV_THD_BSHD_BSHD Paged_KV_THD_SBHD_SBHD "
    "BHSD_BHSD_BHSD QKV_Layout_NOT_SET"
).split()
NVTE_QKV_Layout = enum.IntEnum("NVTE_QKV_Layout", {f"NVTE_{n}": i for i, n in enumerate(_QKV_LAYOUTS)})


class CommOverlapType(enum.IntEnum):
    RS = 0
    AG = 1


class CommOverlapAlgo(enum.IntEnum):
    BULK_OVERLAP_AG = 0
    BULK_OVERLAP_RS = 1
    SPLIT_PIPELINED_AG_P2P = 2
    SPLIT_PIPELINED_RS = 3
    SPLIT_PIPELINED_RS_P2P = 4
    ATOMIC_GEMM_RS = 5
    ATOMIC_GEMM_AG_P2P = 6
    ATOMIC_GEMM_RS_P2P = 7
    EXTERNAL_BULK_OVERLAP_AG = 8


class Float8BlockScaleTensorFormat(enum.IntEnum):
    GEMM_READY = 0
    COMPACT = 1
    INVALID = 2


class _NotOnCpu:
    """Classes of TE's extension that need GPU hardware (userbuffers, NVSHMEM, cuSolverMp)."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(
            f"transformer_engine_torch.{type(self).__name__} is not available in the CPU rehearsal "
            "(userbuffers / comm-GEMM overlap need GPUs)"
        )


class CommOverlapCore(_NotOnCpu):
    pass


class CommOverlapBase(CommOverlapCore):
    pass


class CommOverlapP2PBase(CommOverlapCore):
    pass


class CommOverlap(CommOverlapBase):
    pass


class CommOverlapP2P(CommOverlapP2PBase):
    pass


class CommOverlapHelper(_NotOnCpu):
    pass


# --------------------------------------------------------------------------------------------------
# Counters

_STATS: Counter = Counter()
_STAT_KEYS = ("fp8_gemms", "fp8_gemms_fwd", "fp8_gemms_bwd", "non_fp8_gemms", "non_fp8_gemms_fwd",
              "non_fp8_gemms_bwd", "amax_reductions", "amax_reductions_fwd", "amax_reductions_bwd",
              "amax_elements_reduced", "scale_updates", "tf32_gemms")
_GROUPS: list = []


def stats() -> dict:
    """What ran since the last ``reset_stats()``: GEMMs (FP8 / high precision, forward / backward),
    delayed-scaling amax reductions (and the group of each: "default" when none was given, "WORLD", or
    its sorted global ranks),
    scale updates, casts per quantizer kind."""
    out = {k: 0 for k in _STAT_KEYS}
    out.update(_STATS)
    out["amax_reduction_groups"] = list(_GROUPS)
    return out


def reset_stats() -> None:
    _STATS.clear()
    _GROUPS.clear()


def record_amax_reduction(group, numel: int) -> None:
    """Called (by te_on_cpu's observer of TE's ``reduce_tensor_across_group_op_max``) per all-reduce."""
    import torch.distributed as dist

    _STATS["amax_reductions"] += 1
    _STATS["amax_reductions_bwd" if cuda_as_cpu.in_backward() else "amax_reductions_fwd"] += 1
    _STATS["amax_elements_reduced"] += int(numel)
    if group is None:
        _GROUPS.append("default")  # no group given: c10d's default group (WORLD)
    elif group is dist.group.WORLD:
        _GROUPS.append("WORLD")
    else:
        _GROUPS.append(sorted(dist.get_process_group_ranks(group)))


# --------------------------------------------------------------------------------------------------
# Numerics

FLT_MAX = torch.finfo(torch.float32).max
_FP8 = {
    int(DType.kFloat8E4M3): (torch.float8_e4m3fn, 448.0),
    int(DType.kFloat8E5M2): (torch.float8_e5m2, 57344.0),
}
_TORCH_OF = {
    int(DType.kByte): torch.uint8,
    int(DType.kInt32): torch.int32,
    int(DType.kFloat32): torch.float32,
    int(DType.kFloat16): torch.float16,
    int(DType.kBFloat16): torch.bfloat16,
    int(DType.kFloat8E4M3): torch.float8_e4m3fn,
    int(DType.kFloat8E5M2): torch.float8_e5m2,
}
_TE_OF = {v: k for k, v in _TORCH_OF.items()}


def _fp8_info(te_dtype):
    try:
        return _FP8[int(te_dtype)]
    except KeyError:
        raise ValueError(f"not an FP8 dtype: {te_dtype!r}") from None


def _torch_dtype(te_or_torch):
    if isinstance(te_or_torch, torch.dtype):
        return te_or_torch
    return _TORCH_OF[int(te_or_torch)]


def cast_to_fp8(x: torch.Tensor, scale: torch.Tensor, te_dtype) -> torch.Tensor:
    """``cvt.rn.satfinite`` of ``x * scale`` (fp32): RNE, saturating, NaN kept. Returns uint8 bits."""
    torch_dtype, fp8_max = _fp8_info(te_dtype)
    scaled = x.float() * scale.float()
    return scaled.clamp(-fp8_max, fp8_max).to(torch_dtype).view(torch.uint8)


def fp8_bits_to_float(bits: torch.Tensor, te_dtype) -> torch.Tensor:
    return bits.view(_fp8_info(te_dtype)[0]).float()


def amax_of(x: torch.Tensor) -> torch.Tensor:
    """Max |x| in fp32, NaN ignored (as the kernels' ``fmaxf``); 0 for an empty tensor."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32)
    a = x.detach().float().abs()
    return torch.where(torch.isnan(a), 0.0, a).max()


def scale_from_amax(amax: float, fp8_max: float, force_pow_2: bool, epsilon: float) -> float:
    """``compute_scale_from_amax`` (common/recipe/recipe_common.cuh), fp32 arithmetic."""
    amax = torch.tensor(amax, dtype=torch.float32)
    if amax < epsilon:
        amax = torch.tensor(epsilon, dtype=torch.float32)
    if torch.isinf(amax) or amax == 0 or torch.isnan(amax):
        return 1.0
    scale = torch.tensor(fp8_max, dtype=torch.float32) / amax
    if torch.isinf(scale):
        scale = torch.tensor(FLT_MAX, dtype=torch.float32)
    if force_pow_2:
        bits = scale.view(torch.int32) & torch.tensor(0xFF800000 - (1 << 32), dtype=torch.int32)
        scale = bits.view(torch.float32)
    return float(scale)


def _non_tn_supported() -> bool:
    return (10, 0) <= cuda_as_cpu.capability() < (12, 0) or cuda_as_cpu.capability() >= (13, 0)


def _transpose_shape(shape):
    shape = list(shape)
    return [shape[-1], *shape[:-1]] if shape else shape


def _transpose_bits(bits: torch.Tensor) -> torch.Tensor:
    if bits.dim() == 0:
        return bits.clone()
    if bits.numel() == 0:  # transpose.cpp fp8_transpose: allocated [last, *rest], returned before the kernel
        return torch.empty(_transpose_shape(bits.shape), dtype=bits.dtype)
    last = bits.shape[-1]
    return bits.reshape(-1, last).t().contiguous().reshape(_transpose_shape(bits.shape))


def _untranspose(bits_t: torch.Tensor) -> torch.Tensor:
    """Logical (row-major) layout of a ``_transpose`` buffer of shape ``[last, *rest]``."""
    first = bits_t.shape[0]
    rest = list(bits_t.shape[1:])
    if bits_t.numel() == 0:
        return torch.empty([*rest, first], dtype=bits_t.dtype)
    return bits_t.reshape(first, -1).t().contiguous().reshape(*rest, first)


# --------------------------------------------------------------------------------------------------
# Quantized tensors


def _te_classes():
    """(Float8Tensor, its storage class) of the installed TE (the storage was ``Float8TensorBase`` in
    ``tensor/_internal`` before 2.10)."""
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Tensor

    try:
        from transformer_engine.pytorch.tensor.storage.float8_tensor_storage import Float8TensorStorage
    except ImportError:
        from transformer_engine.pytorch.tensor._internal.float8_tensor_base import (
            Float8TensorBase as Float8TensorStorage,
        )
    return Float8Tensor, Float8TensorStorage


def _accepted(cls, kwargs: dict) -> dict:
    """``kwargs`` less the keywords that the installed TE's constructors (``cls`` and its
    ``QuantizedTensor`` base) do not take: they grew ``fake_dtype``, ``device`` and ``stride`` over time."""
    names = _constructor_keywords(cls)
    return {k: v for k, v in kwargs.items() if k in names}


@functools.cache
def _constructor_keywords(cls) -> frozenset:
    """The keywords ``cls(...)`` takes, read once per class: ``inspect.signature`` parses a signature text each
    time, and every quantized tensor the shim makes asked (a third of a training step's time on CPU)."""
    import inspect

    names = set()
    for klass in cls.__mro__:
        new = vars(klass).get("__new__")
        if new is None:
            continue
        params = inspect.signature(new).parameters
        names |= {n for n, p in params.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            break
    return frozenset(names)


def _make_float8(quantizer, shape, fake_dtype, data, transpose, scale_inv):
    Float8Tensor, Float8TensorStorage = _te_classes()
    common = dict(data=data, fp8_scale_inv=scale_inv, fp8_dtype=quantizer.dtype, data_transpose=transpose,
                  quantizer=quantizer)
    if quantizer.internal:
        return Float8TensorStorage(**_accepted(Float8TensorStorage, {**common, "fake_dtype": fake_dtype}))
    return Float8Tensor(**_accepted(Float8Tensor, {**common, "shape": list(shape), "dtype": fake_dtype,
                                                   "device": torch.device("cpu")}))


def _is_float8(t) -> bool:
    return hasattr(t, "_fp8_dtype") and hasattr(t, "_scale_inv") and hasattr(t, "_transpose")


_KINDS = ("Float8Quantizer", "Float8CurrentScalingQuantizer", "MXFP8Quantizer", "Float8BlockQuantizer",
          "NVFP4Quantizer")


def _quantizer_kind(quantizer) -> str:
    name = type(quantizer).__name__
    if name in _KINDS:
        return name
    raise NotImplementedError(
        f"transformer_engine_torch.quantize with {name}: not implemented by the CPU rehearsal "
        f"(implemented: {', '.join(_KINDS)})"
    )


def _usages(quantizer):
    non_tn = _non_tn_supported()
    return quantizer.rowwise_usage or non_tn, quantizer.columnwise_usage and not non_tn


def _scale_for(quantizer, x: torch.Tensor):
    """(scale tensor [1], amax tensor) for the cast, per recipe; updates delayed-scaling amax."""
    kind = _quantizer_kind(quantizer)
    amax = amax_of(x)
    if kind == "Float8Quantizer":
        quantizer.amax.copy_(torch.maximum(quantizer.amax, amax.reshape(quantizer.amax.shape)))
        return quantizer.scale.detach().float().reshape(1)
    # Float8CurrentScalingQuantizer: amax of this tensor (reduced over the group when asked), scale now.
    if quantizer.with_amax_reduction:
        import torch.distributed as dist

        _STATS["amax_allreduce_current_scaling"] += 1
        amax = amax.clone()
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=quantizer.amax_reduction_group)
    _, fp8_max = _fp8_info(quantizer.dtype)
    scale = scale_from_amax(float(amax), fp8_max, quantizer.force_pow_2_scales, quantizer.amax_epsilon)
    return torch.tensor([scale], dtype=torch.float32)



# --------------------------------------------------------------------------------------------------
# MXFP8: 32-element blocks, power-of-two scales stored as E8M0 (biased exponents)

MXFP8_BLOCK = 32


def float_to_e8m0(value: torch.Tensor) -> torch.Tensor:
    """``ptx::float_to_e8m0`` (common/util/ptx_arch_spec.cuh): the biased exponent of ``value`` rounded up
    to a power of two, saturating; NaN -> 0xFF, inf -> 0xFE, 0 -> 0. uint8."""
    v = value.float().contiguous()
    bits = v.view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    round_up = (mantissa > 0) & (exponent != 0xFE) & ~((exponent == 0) & (mantissa <= 0x400000))
    out = exponent + round_up.to(exponent.dtype)
    out = torch.where(v == 0, torch.zeros_like(out), out)
    out = torch.where(torch.isinf(v), torch.full_like(out, 0xFE), out)
    out = torch.where(torch.isnan(v), torch.full_like(out, 0xFF), out)
    return out.to(torch.uint8)


def e8m0_to_scale(e8m0: torch.Tensor, inverse: bool) -> torch.Tensor:
    """An E8M0 byte as an fp32 factor, bit for bit as TE 2.20's ``common/util/ptx.cuh`` builds it
    (``exp2f_rcp`` fixed in TE PR #2647, ``exp2f`` in #3262; both in release_v2.19 and later):

    - ``inverse`` = ``ptx::exp2f_rcp<float>`` (the quantizing multiplier 2**(127 - e)): 255 -> NaN with the
      bits 0x7fffffff, 254 -> 0x00400000 (2**-127, a subnormal), else ``(254 - e) << 23`` (so e = 0 gives
      2**127: no special case for 0 in 2.20; older TE returned 1 there);
    - otherwise ``ptx::exp2f`` (the dequantization factor 2**(e - 127), as TE's dequantize kernel and the
      OCP MX rule cuBLAS follows): 255 -> NaN 0x7fffffff, 0 -> 0x00400000 (2**-127), else ``e << 23``.
    """
    e = e8m0.to(torch.int32)
    if inverse:
        bits = torch.where(e == 254, torch.full_like(e, 0x00400000), (254 - e).clamp(min=0) << 23)
    else:
        bits = torch.where(e == 0, torch.full_like(e, 0x00400000), e << 23)
    bits = torch.where(e == 255, torch.full_like(e, 0x7FFFFFFF), bits)
    return bits.view(torch.float32)


def _roundup(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _mxfp8_2d(shape):
    if not shape:
        raise RuntimeError("MXFP8 requires at least a 1-D tensor")
    last = shape[-1]
    first = math.prod(shape[:-1]) if len(shape) > 1 else 1
    if first % MXFP8_BLOCK or last % MXFP8_BLOCK:
        raise RuntimeError(f"MXFP8 requires tensor dims that are divisible by {MXFP8_BLOCK} (got shape={list(shape)})")
    return first, last


def mxfp8_quantize_2d(x2: torch.Tensor, te_dtype, columnwise: bool):
    """(FP8 bits [M, K], E8M0 scales [M, K/32] row-wise or [M/32, K] column-wise), TE's block rule:
    scale exponent = float_to_e8m0(block amax / fp8 max), data = satfinite(x * 2**(127 - e))."""
    _, fp8_max = _fp8_info(te_dtype)
    m, k = x2.shape
    x32 = x2.float()
    if columnwise:
        blocks = x32.reshape(m // MXFP8_BLOCK, MXFP8_BLOCK, k)
        amax = torch.where(torch.isnan(blocks), 0.0, blocks.abs()).amax(dim=1)  # [M/32, K]
        e = float_to_e8m0(amax * (1.0 / fp8_max))
        scaled = blocks * e8m0_to_scale(e, inverse=True)[:, None, :]
    else:
        blocks = x32.reshape(m, k // MXFP8_BLOCK, MXFP8_BLOCK)
        amax = torch.where(torch.isnan(blocks), 0.0, blocks.abs()).amax(dim=2)  # [M, K/32]
        e = float_to_e8m0(amax * (1.0 / fp8_max))
        scaled = blocks * e8m0_to_scale(e, inverse=True)[:, :, None]
    bits = cast_to_fp8(scaled.reshape(m, k), torch.ones(1), te_dtype)
    return bits, e


def mxfp8_dequantize_2d(bits: torch.Tensor, e8m0: torch.Tensor, te_dtype, columnwise: bool) -> torch.Tensor:
    m, k = bits.shape
    values = fp8_bits_to_float(bits, te_dtype)
    if columnwise:
        factors = e8m0_to_scale(e8m0[: m // MXFP8_BLOCK, :k], inverse=False)
        return (values.reshape(m // MXFP8_BLOCK, MXFP8_BLOCK, k) * factors[:, None, :]).reshape(m, k)
    factors = e8m0_to_scale(e8m0[:m, : k // MXFP8_BLOCK], inverse=False)
    return (values.reshape(m, k // MXFP8_BLOCK, MXFP8_BLOCK) * factors[:, :, None]).reshape(m, k)


def _padded_scales(e8m0: torch.Tensor, columnwise: bool, m: int, k: int) -> torch.Tensor:
    """The scale buffer in the shape TE allocates (``MXFP8Quantizer::get_scale_shape``), compact layout."""
    if columnwise:
        out = torch.zeros(_roundup(m // MXFP8_BLOCK, 4), _roundup(k, 128), dtype=torch.uint8)
    else:
        out = torch.zeros(_roundup(m, 128), _roundup(k // MXFP8_BLOCK, 4), dtype=torch.uint8)
    out[: e8m0.shape[0], : e8m0.shape[1]] = e8m0
    return out


def _is_mxfp8(t) -> bool:
    return (hasattr(t, "_rowwise_scale_inv") and hasattr(t, "_columnwise_scale_inv") and hasattr(t, "_rowwise_data")
            and hasattr(t, "_fp8_dtype") and not hasattr(t, "_is_2D_scaled"))


def _is_block_fp8(t) -> bool:
    """A ``Float8BlockwiseQTensor`` / its storage (1x128 or 128x128 blocks, FP32 scales)."""
    return hasattr(t, "_is_2D_scaled") and hasattr(t, "_rowwise_data") and hasattr(t, "_fp8_dtype")


def _is_nvfp4(t) -> bool:
    """An ``NVFP4Tensor`` / its storage (E2M1 data, E4M3 block scales, FP32 per-tensor amax)."""
    return hasattr(t, "_fp4_dtype") and hasattr(t, "_amax_rowwise")


def _mxfp8_classes():
    from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Tensor

    try:
        from transformer_engine.pytorch.tensor.storage.mxfp8_tensor_storage import MXFP8TensorStorage
    except ImportError:
        from transformer_engine.pytorch.tensor._internal.mxfp8_tensor_base import (
            MXFP8TensorBase as MXFP8TensorStorage,
        )
    return MXFP8Tensor, MXFP8TensorStorage


def _quantize_mxfp8(x: torch.Tensor, quantizer, output=None):
    """Scales are kept compact (``with_gemm_swizzled_scales=False``, whatever ``optimize_for_gemm`` says): only
    this shim reads them, and its ``swizzle_scales_for_gemm_`` refuses to swizzle them."""
    m, k = _mxfp8_2d(tuple(x.shape))
    x2 = x.reshape(m, k)
    parts = {}
    for columnwise, usage in ((False, quantizer.rowwise_usage), (True, quantizer.columnwise_usage)):
        name = "columnwise" if columnwise else "rowwise"
        if usage:
            bits, e = mxfp8_quantize_2d(x2, quantizer.dtype, columnwise)
            parts[f"{name}_data"] = bits.reshape(x.shape)
            parts[f"{name}_scale_inv"] = _padded_scales(e, columnwise, m, k)
        else:
            parts[f"{name}_data"] = parts[f"{name}_scale_inv"] = None
    if output is not None:
        for key, value in parts.items():
            setattr(output, "_" + key, value)
        output._with_gemm_swizzled_scales = False
        return output
    MXFP8Tensor, MXFP8TensorStorage = _mxfp8_classes()
    common = dict(parts, fp8_dtype=quantizer.dtype, quantizer=quantizer, with_gemm_swizzled_scales=False)
    if quantizer.internal:
        return MXFP8TensorStorage(**_accepted(MXFP8TensorStorage, {**common, "fake_dtype": x.dtype}))
    return MXFP8Tensor(**_accepted(MXFP8Tensor, {**common, "shape": list(x.shape), "dtype": x.dtype,
                                                 "device": torch.device("cpu")}))


def _dequantize_mxfp8(t, rowwise: bool = True, who: str = "dequantize") -> torch.Tensor:
    name = "rowwise" if rowwise else "columnwise"
    if getattr(t, f"_{name}_data") is None:
        if who != "dequantize":
            raise RuntimeError(f"{who}: MXFP8 tensor has no {name} data, which this GEMM layout needs")
        rowwise, name = not rowwise, "columnwise" if rowwise else "rowwise"
    bits = getattr(t, f"_{name}_data")
    m, k = _mxfp8_2d(tuple(bits.shape))
    out = mxfp8_dequantize_2d(bits.reshape(m, k), getattr(t, f"_{name}_scale_inv"), t._fp8_dtype, not rowwise)
    return out.reshape(bits.shape)


# --------------------------------------------------------------------------------------------------
# FP8 block scaling (Float8BlockScaling): 1x128 or 128x128 blocks, FP32 scales
# (common/transpose/quantize_transpose_{vector,square}_blockwise.cu, recipe/recipe_common.cuh)

FP8_BLOCK = 128
_BLACKWELL_BLOCK_POW2 = ("On Blackwell and newer, the FP8 block scaling recipe is emulated with MXFP8, which "
                         "requires using power of two scaling factors.")


def _nan_free_abs(x: torch.Tensor) -> torch.Tensor:
    """|x| with NaN as 0: the kernels' ``fmaxf`` amax never picks a NaN."""
    a = x.abs()
    return torch.where(torch.isnan(a), torch.zeros_like(a), a)


def block_scale_from_amax(amax: torch.Tensor, fp8_max: float, force_pow_2: bool, epsilon: float,
                          value_for_inf: float) -> torch.Tensor:
    """``compute_scale_from_amax`` elementwise in fp32: amax floored at epsilon; 1 for an amax that is 0, inf or
    NaN; ``fp8_max / amax`` (``__fdiv_rn``), an infinite quotient replaced by ``value_for_inf`` (the input
    type's largest finite value, ``compute_scale_from_types``); with ``force_pow_2`` the mantissa cleared."""
    amax = amax.float()
    amax = torch.where(amax < epsilon, torch.full_like(amax, epsilon), amax)
    scale = torch.full_like(amax, fp8_max) / amax
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, value_for_inf), scale)
    if force_pow_2:
        mask = torch.tensor(0xFF800000 - (1 << 32), dtype=torch.int32)
        scale = (scale.contiguous().view(torch.int32) & mask).view(torch.float32)
    degenerate = torch.isinf(amax) | (amax == 0) | torch.isnan(amax)
    return torch.where(degenerate, torch.ones_like(scale), scale)


def _fp8_block_rows(x2: torch.Tensor, te_dtype, force_pow_2: bool, epsilon: float, value_for_inf: float):
    """1x128 blocks along the rows of ``x2`` [R, C]: (bits [R, C], scale_inv [R, ceil(C/128)])."""
    rows, cols = x2.shape
    nblk = -(-cols // FP8_BLOCK)
    padded = torch.nn.functional.pad(x2.float(), (0, nblk * FP8_BLOCK - cols))
    blocks = padded.reshape(rows, nblk, FP8_BLOCK)
    scale = block_scale_from_amax(_nan_free_abs(blocks).amax(dim=2), _fp8_info(te_dtype)[1], force_pow_2,
                                  epsilon, value_for_inf)
    bits = cast_to_fp8(blocks, scale[:, :, None], te_dtype).reshape(rows, nblk * FP8_BLOCK)[:, :cols]
    return bits.contiguous(), torch.ones_like(scale) / scale


def _fp8_block_tiles(x2: torch.Tensor, te_dtype, force_pow_2: bool, epsilon: float, value_for_inf: float):
    """128x128 tiles of ``x2`` [R, C]: (bits [R, C], scale_inv [ceil(R/128), ceil(C/128)])."""
    rows, cols = x2.shape
    rb, cb = -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)
    padded = torch.nn.functional.pad(x2.float(), (0, cb * FP8_BLOCK - cols, 0, rb * FP8_BLOCK - rows))
    tiles = padded.reshape(rb, FP8_BLOCK, cb, FP8_BLOCK)
    scale = block_scale_from_amax(_nan_free_abs(tiles).amax(dim=(1, 3)), _fp8_info(te_dtype)[1], force_pow_2,
                                  epsilon, value_for_inf)
    bits = cast_to_fp8(tiles, scale[:, None, :, None], te_dtype).reshape(rb * FP8_BLOCK, cb * FP8_BLOCK)
    return bits[:rows, :cols].contiguous(), torch.ones_like(scale) / scale


def _padded_fp32(values: torch.Tensor, shape) -> torch.Tensor:
    """``values`` in the top-left corner of a buffer of TE's scale shape (the kernels leave the padding
    unwritten; here it is 0)."""
    out = torch.zeros(list(shape), dtype=torch.float32)
    out[: values.shape[0], : values.shape[1]] = values
    return out


def fp8_block_quantize_2d(x2: torch.Tensor, te_dtype, block_scaling_dim: int, *, rowwise: bool, columnwise: bool,
                          force_pow_2: bool = True, epsilon: float = 0.0, value_for_inf: float = FLT_MAX):
    """Float8BlockQuantizer's buffers for a 2-D ``x2`` [M, K], in the layouts TE's kernels write:

    - row-wise data [M, K]; column-wise data [K, M] (the transpose);
    - 2-D (128x128): row-wise scale_inv [ceil(M/128), roundup(ceil(K/128), 4)] at [m_tile, k_tile], column-wise
      [ceil(K/128), roundup(ceil(M/128), 4)] at [k_tile, m_tile] (same tiles, transposed);
    - 1-D (1x128 along the data's rows), GEMM_READY (scales transposed): row-wise scale_inv
      [ceil(K/128), roundup(M, 4)] at [k_block, m]; column-wise (1x128 blocks of the transposed data, i.e.
      128 x 1 blocks down each column) [ceil(M/128), roundup(K, 4)] at [m_block, k].

    Returns {"rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv"} (None when unused)."""
    m, k = x2.shape
    out = dict(rowwise_data=None, rowwise_scale_inv=None, columnwise_data=None, columnwise_scale_inv=None)
    kw = dict(force_pow_2=force_pow_2, epsilon=epsilon, value_for_inf=value_for_inf)
    if block_scaling_dim == 2:
        bits, sinv = _fp8_block_tiles(x2, te_dtype, **kw)
        rb, cb = sinv.shape
        if rowwise:
            out["rowwise_data"] = bits
            out["rowwise_scale_inv"] = _padded_fp32(sinv, (rb, _roundup(cb, 4)))
        if columnwise:
            out["columnwise_data"] = bits.t().contiguous()
            out["columnwise_scale_inv"] = _padded_fp32(sinv.t(), (cb, _roundup(rb, 4)))
        return out
    if block_scaling_dim != 1:
        raise RuntimeError(f"Float8BlockQuantizer: block_scaling_dim must be 1 or 2, not {block_scaling_dim}")
    if rowwise:
        bits, sinv = _fp8_block_rows(x2, te_dtype, **kw)  # [M, ceil(K/128)]
        out["rowwise_data"] = bits
        out["rowwise_scale_inv"] = _padded_fp32(sinv.t(), (sinv.shape[1], _roundup(m, 4)))
    if columnwise:
        bits_t, sinv_t = _fp8_block_rows(x2.t(), te_dtype, **kw)  # [K, ceil(M/128)]
        out["columnwise_data"] = bits_t
        out["columnwise_scale_inv"] = _padded_fp32(sinv_t.t(), (sinv_t.shape[1], _roundup(k, 4)))
    return out


def fp8_block_dequantize_2d(bits: torch.Tensor, scale_inv: torch.Tensor, te_dtype, block_scaling_dim: int) -> torch.Tensor:
    """fp32 values of one usage's data [R, C] (row-wise: [M, K]; column-wise: the transposed [K, M]) from its
    scale buffer as ``fp8_block_quantize_2d`` lays it out."""
    rows, cols = bits.shape
    values = fp8_bits_to_float(bits, te_dtype)
    cb = -(-cols // FP8_BLOCK)
    if block_scaling_dim == 2:
        rb = -(-rows // FP8_BLOCK)
        factors = scale_inv[:rb, :cb].repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)
    else:
        factors = scale_inv[:cb, :rows].t().repeat_interleave(FP8_BLOCK, 1)
    return values * factors[:rows, :cols]


def _block_classes():
    """(Float8BlockwiseQTensor, its storage class): ``tensor/storage`` since TE 2.10, ``tensor/_internal`` before."""
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockwiseQTensor

    try:
        from transformer_engine.pytorch.tensor.storage.float8_blockwise_tensor_storage import (
            Float8BlockwiseQTensorStorage,
        )
    except ImportError:
        from transformer_engine.pytorch.tensor._internal.float8_blockwise_tensor_base import (
            Float8BlockwiseQTensorBase as Float8BlockwiseQTensorStorage,
        )
    return Float8BlockwiseQTensor, Float8BlockwiseQTensorStorage


def _flat_2d(shape) -> tuple[int, int]:
    last = shape[-1] if len(shape) else 1
    return (math.prod(shape[:-1]) if len(shape) > 1 else 1), last


def _store(output, parts: dict) -> None:
    """Write ``parts`` into an existing quantized tensor as its kernel would: into the buffers it has (same
    shape), new buffers where it has none; usages the quantizer does not ask for are dropped
    (``convert_and_update_tensor``)."""
    for key, value in parts.items():
        attr = "_" + key
        current = getattr(output, attr, None)
        if value is None:
            setattr(output, attr, None)
        elif isinstance(current, torch.Tensor) and current.shape == value.shape and current.dtype == value.dtype:
            current.copy_(value)
        else:
            setattr(output, attr, value)


def _quantize_block_fp8(x: torch.Tensor, quantizer, output=None):
    if getattr(quantizer, "all_gather_usage", False):  # TE < 2.10: COMPACT scales for FP8 all-gathers
        raise NotImplementedError("transformer_engine_torch.quantize with Float8BlockQuantizer(all_gather_usage=True) "
                                  "(the COMPACT block-scale format of TE < 2.10): not implemented by the CPU rehearsal")
    if cuda_as_cpu.capability() >= (10, 0) and not quantizer.force_pow_2_scales:
        raise RuntimeError(_BLACKWELL_BLOCK_POW2)
    shape = list(x.shape)
    m, k = _flat_2d(shape)
    value_for_inf = torch.finfo(x.dtype).max if x.dtype.is_floating_point else FLT_MAX
    parts = fp8_block_quantize_2d(
        x.reshape(m, k), quantizer.dtype, quantizer.block_scaling_dim, rowwise=quantizer.rowwise_usage,
        columnwise=quantizer.columnwise_usage, force_pow_2=quantizer.force_pow_2_scales,
        epsilon=quantizer.amax_epsilon, value_for_inf=value_for_inf)
    if parts["rowwise_data"] is not None:
        parts["rowwise_data"] = parts["rowwise_data"].reshape(shape)
    if parts["columnwise_data"] is not None:
        parts["columnwise_data"] = parts["columnwise_data"].reshape(_transpose_shape(shape))
    if output is not None:
        _store(output, parts)
        return output
    Tensor, Storage = _block_classes()
    common = dict(parts, fp8_dtype=quantizer.dtype, quantizer=quantizer,
                  is_2D_scaled=quantizer.block_scaling_dim == 2)
    if quantizer.internal:
        return Storage(**_accepted(Storage, {**common, "fake_dtype": x.dtype}))
    return Tensor(**_accepted(Tensor, {**common, "shape": shape, "dtype": x.dtype,
                                       "device": torch.device("cpu")}))


def _dequantize_block_fp8(t, rowwise: bool = True) -> torch.Tensor:
    """Logical-layout fp32 values of a block-scaled tensor from its row-wise (or column-wise) data."""
    if t._rowwise_data is None and rowwise:
        rowwise = False
    dim = 2 if t._is_2D_scaled else 1
    if rowwise:
        bits = t._rowwise_data
        r, c = _flat_2d(list(bits.shape))
        return fp8_block_dequantize_2d(bits.reshape(r, c), t._rowwise_scale_inv, t._fp8_dtype, dim).reshape(bits.shape)
    bits_t = t._columnwise_data
    first = bits_t.shape[0]
    values_t = fp8_block_dequantize_2d(bits_t.reshape(first, -1), t._columnwise_scale_inv, t._fp8_dtype, dim)
    return values_t.t().reshape(*bits_t.shape[1:], first)


def _check_block_gemm(A, transA: bool, B, transB: bool) -> None:
    """What cuBLAS (and TE's Blackwell emulation) refuse for block-scaled operands (cublaslt_gemm.cu)."""
    if not (_is_block_fp8(A) and _is_block_fp8(B)):
        return
    if A._is_2D_scaled and B._is_2D_scaled:
        raise RuntimeError("Only 1D by 1D, 1D by 2D, and 2D by 1D block scaling GEMM is supported, but got 2D by 2D")
    if cuda_as_cpu.capability() < (10, 0):  # cuBLAS' own block-scaled GEMM (Hopper): its alignment rules
        a0, a1 = _flat_2d(list(A.size()))
        b0, b1 = _flat_2d(list(B.size()))
        m, k, n = (a0 if transA else a1), (a1 if transA else a0), (b1 if transB else b0)
        if k % 16:
            raise RuntimeError("Leading dimension requirement on NVTE_BLOCK_SCALING GEMM. Caller must pad.")
        if m % 8:
            raise RuntimeError("Outer dimension requirement on A for NVTE_BLOCK_SCALING GEMM. Caller must pad.")
        if not B._is_2D_scaled and n % 8:
            raise RuntimeError("Outer dimension requirement on B for NVTE_BLOCK_SCALING GEMM. Caller must pad.")
    if cuda_as_cpu.capability() >= (10, 0):  # converted to MXFP8: the scales' exponent bytes only
        for t in (A, B):
            for s in (t._rowwise_scale_inv, t._columnwise_scale_inv):
                if s is not None and bool(((s.contiguous().view(torch.int32) & 0x7FFFFF) != 0).any()):
                    raise RuntimeError(_BLACKWELL_BLOCK_POW2)

# --------------------------------------------------------------------------------------------------
# NVFP4 (NVFP4BlockScaling): E2M1 values, an E4M3 scale per 16 values, an FP32 per-tensor amax
# (common/cast/nvfp4/core_nvfp4.cuh, quantize_transpose_nvfp4.cuh, dequantize_nvfp4.cuh,
#  util/ptx_arch_spec.cuh, pytorch/csrc/quantizer.cpp NVFP4Quantizer::quantize_impl)

NVFP4_BLOCK = 16
FP4_MAX = 6.0
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0..7; bit 3 is the sign
_E2M1_VALUES = torch.tensor([*E2M1_GRID, *(-v for v in E2M1_GRID)], dtype=torch.float32)


def _f32(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32)


def nvfp4_global_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """``compute_global_encode_scaling_factor_FP4``: (448 * 6) / amax in fp32, at most FLT_MAX; 1 when the amax is
    0 or the quotient is 0 (an infinite amax)."""
    amax = amax.float()
    scale = torch.minimum(_f32(448.0 * FP4_MAX) / amax, _f32(FLT_MAX))
    return torch.where((amax == 0) | (scale == 0), torch.ones_like(scale), scale)


def e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """``cvt.rn.satfinite.e2m1`` of fp32 ``v``: round to nearest, ties to the even code, saturate at ±6; the sign
    bit kept (-0 -> 0x8); NaN -> 0x7 (satfinite). uint8 codes 0..15."""
    a = v.abs().clamp(max=FP4_MAX)
    code = ((a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5)
            + (a > 5.0)).to(torch.uint8)
    code = torch.where(torch.signbit(v), code | 8, code)
    return torch.where(torch.isnan(v), torch.full_like(code, 7), code)


def e2m1_codes_stochastic(v: torch.Tensor, generator=None) -> torch.Tensor:
    """``cvt.rs.satfinite.e2m1``: rounds |v| up to the next grid value with probability (|v| - lower) / gap, from
    uniform draws of ``generator`` (the kernel draws Philox bits from TE's CUDA generator, which the rehearsal
    maps to the CPU one: the same distribution, not the same bits)."""
    a = v.abs().clamp(max=FP4_MAX)
    grid = torch.tensor(E2M1_GRID, dtype=torch.float32)
    lower = (torch.bucketize(a, grid, right=True) - 1).clamp(0, 6)
    lo, hi = grid[lower], grid[lower + 1]
    up = torch.rand(a.shape, generator=generator) * (hi - lo) < (a - lo)
    code = (lower + up.to(lower.dtype)).to(torch.uint8)
    code = torch.where(a >= FP4_MAX, torch.full_like(code, 7), code)
    code = torch.where(torch.signbit(v), code | 8, code)
    return torch.where(torch.isnan(v), torch.full_like(code, 7), code)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Two E2M1 codes a byte, the even element in the low nibble. [..., C] -> [..., C/2] uint8."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def nvfp4_quantize_rows(x2: torch.Tensor, global_amax: torch.Tensor, *, tile_2d: bool = False,
                        stochastic: bool = False, generator=None):
    """E2M1 codes packed [R, C/2] and E4M3 scale bits [R, ceil(C/16)] for ``x2`` [R, C] (C even), the kernel's
    arithmetic in fp32:

    S_enc = nvfp4_global_encode_scale(global amax), S_dec = 1 / S_enc;
    per block (1x16 of a row, or the 16x16 tile holding it): S_dec_b = block_amax * (S_enc * (1/6)) cast to E4M3
    (satfinite); values = E2M1(x * min(1 / (S_dec_b * S_dec), FLT_MAX)).
    A partial last block (C, or R for 2-D tiles, not a multiple of 16) takes the amax of its values, as the
    unaligned kernel (quantize_transpose_vector_blockwise_fp4.cu) does."""
    true_rows, true_cols = x2.shape
    if true_cols % 2:
        raise RuntimeError(f"NVFP4 packs two values a byte: the last dim must be even (got {true_cols})")
    pad_rows = (-true_rows) % NVFP4_BLOCK if tile_2d else 0
    x32 = torch.nn.functional.pad(x2.float(), (0, (-true_cols) % NVFP4_BLOCK, 0, pad_rows))
    rows, cols = x32.shape
    s_enc = nvfp4_global_encode_scale(global_amax.reshape(()))
    s_dec = torch.ones((), dtype=torch.float32) / s_enc
    blocks = _nan_free_abs(x32).reshape(rows, cols // NVFP4_BLOCK, NVFP4_BLOCK)
    if tile_2d:
        tiles = blocks.reshape(rows // NVFP4_BLOCK, NVFP4_BLOCK, cols // NVFP4_BLOCK, NVFP4_BLOCK)
        block_amax = tiles.amax(dim=(1, 3)).repeat_interleave(NVFP4_BLOCK, 0)
    else:
        block_amax = blocks.amax(dim=2)
    s_dec_b = block_amax * (s_enc * _f32(1.0 / FP4_MAX))
    s_dec_b_bits = cast_to_fp8(torch.minimum(s_dec_b, _f32(FLT_MAX)), torch.ones(1), DType.kFloat8E4M3)
    s_dec_b_fp8 = fp8_bits_to_float(s_dec_b_bits, DType.kFloat8E4M3)
    encode = torch.minimum(torch.ones(()) / (s_dec_b_fp8 * s_dec), _f32(FLT_MAX))
    scaled = (x32.reshape(rows, cols // NVFP4_BLOCK, NVFP4_BLOCK) * encode[:, :, None]).reshape(rows, cols)
    codes = e2m1_codes_stochastic(scaled, generator) if stochastic else e2m1_codes(scaled)
    return pack_fp4(codes[:true_rows, :true_cols]), s_dec_b_bits[:true_rows].contiguous()


def nvfp4_dequantize_rows(packed: torch.Tensor, scale_bits: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """``dequantize_fp4_kernel``: value * (E4M3 scale * amax * (1 / (6 * 448))), fp32. ``scale_bits`` may be the
    padded buffer; its top-left [R, C/16] is read."""
    rows, half = packed.shape
    cols = half * 2
    nblk = -(-cols // NVFP4_BLOCK)
    values = _E2M1_VALUES[unpack_fp4(packed).long()]
    scales = fp8_bits_to_float(scale_bits[:rows, :nblk].contiguous(), DType.kFloat8E4M3)
    final = scales * amax.float().reshape(()) * _f32(1.0 / (FP4_MAX * 448.0))
    return values * final.repeat_interleave(NVFP4_BLOCK, 1)[:, :cols]


def _padded_u8(values: torch.Tensor, shape) -> torch.Tensor:
    out = torch.zeros(list(shape), dtype=torch.uint8)
    out[: values.shape[0], : values.shape[1]] = values
    return out


def nvfp4_hadamard(x2: torch.Tensor, rht_matrix: torch.Tensor) -> torch.Tensor:
    """The random Hadamard transform of TE's NVFP4 column-wise path: each run of 16 values along the rows of
    ``x2`` (bf16) times ``rht_matrix`` (the quantizer's 16x16 bf16 sign-flipped, 1/4-scaled Hadamard matrix),
    fp32 products and sums, the result in bf16 (the unfused kernel's output type)."""
    rows, cols = x2.shape
    out = x2.float().reshape(-1, NVFP4_BLOCK) @ rht_matrix.float()
    return out.reshape(rows, cols).to(torch.bfloat16)


def _nvfp4_arch_check() -> None:
    if cuda_as_cpu.capability() >= (10, 0):
        return
    try:
        from transformer_engine.pytorch.quantization import check_nvfp4_support

        reason = check_nvfp4_support()[1]
    except ImportError:  # pragma: no cover - TE before 2.9
        reason = "Device compute capability 10.0 or higher required for NVFP4 execution."
    raise RuntimeError(
        f"{reason} (TE's own answer, transformer_engine.pytorch.is_nvfp4_available(); on this GPU TE's NVFP4 cast "
        "kernels stop with 'FP4 cvt PTX instructions are architecture-specific'). The rehearsal answers as sm"
        f"{''.join(map(str, cuda_as_cpu.capability()))}: set {cuda_as_cpu.ENV_ARCH}=sm100 for a Blackwell.")


def _nvfp4_classes():
    """(NVFP4Tensor, its storage class): ``tensor/storage`` since TE 2.10, ``tensor/_internal`` before."""
    from transformer_engine.pytorch.tensor.nvfp4_tensor import NVFP4Tensor

    try:
        from transformer_engine.pytorch.tensor.storage.nvfp4_tensor_storage import NVFP4TensorStorage
    except ImportError:
        from transformer_engine.pytorch.tensor._internal.nvfp4_tensor_base import (
            NVFP4TensorBase as NVFP4TensorStorage,
        )
    return NVFP4Tensor, NVFP4TensorStorage


def _quantize_nvfp4(x: torch.Tensor, quantizer, output=None, empty: bool = False):
    """NVFP4Quantizer::quantize_impl: global amax (row-wise: of x; column-wise: of RHT(x^T) when ``with_rht``,
    else the same), MAX-reduced over ``amax_reduction_group`` when asked, then the cast of x (row-wise, [M, K/2])
    and of x^T or RHT(x^T) (column-wise, [K, M/2]). Scales compact (``with_gemm_swizzled_scales=False``), as
    for MXFP8. 4over6 and row-scaled NVFP4 are not implemented (NotImplementedError)."""
    _nvfp4_arch_check()
    for option in ("row_scaled_nvfp4", "nvfp4_use_4over6"):
        if getattr(quantizer, option, False):
            raise NotImplementedError(f"transformer_engine_torch.quantize with NVFP4Quantizer({option}=True): not "
                                      "implemented by the CPU rehearsal")
    shape = list(x.shape)
    m, k = _flat_2d(shape)
    if quantizer.with_rht and quantizer.columnwise_usage and (m % NVFP4_BLOCK or k % NVFP4_BLOCK):
        raise RuntimeError(f"NVFP4 random Hadamard transform of shape {shape} (flattened [{m}, {k}]): num_rows "
                           "and row_length must be divisible by hadamard_dimension (16)")
    if quantizer.with_rht and not empty:
        if x.dtype != torch.bfloat16:
            raise RuntimeError(f"RHT is only supported for bfloat16 input, got dtype enum value "
                               f"{int(_TE_OF.get(x.dtype, -1))} (TE's own rule, quantizer.cpp: {x.dtype} input to "
                               "NVFP4BlockScaling's random Hadamard transform, which inputs and gradients use; "
                               "run the TE modules in bfloat16, or set NVTE_NVFP4_DISABLE_RHT=1 before TE is "
                               "imported)")
        if not quantizer.with_post_rht_amax:
            raise RuntimeError("Pre-RHT amax is not supported yet. Use with_post_rht_amax=true instead.")
    x2 = x.reshape(m, k)
    col_input = x2.t()
    if quantizer.with_rht and quantizer.columnwise_usage and not empty:
        col_input = nvfp4_hadamard(x2.t().contiguous(), quantizer.rht_matrix)
    amax_row = amax_of(x2).reshape(1)
    amax_col = amax_of(col_input).reshape(1) if quantizer.with_rht else amax_row.clone()
    if quantizer.with_amax_reduction and not empty:
        import torch.distributed as dist

        _STATS["amax_allreduce_nvfp4"] += 1
        both = torch.cat([amax_row, amax_col])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=quantizer.amax_reduction_group)
        amax_row, amax_col = both[:1].clone(), both[1:].clone()
    kw = dict(tile_2d=quantizer.with_2d_quantization, stochastic=quantizer.stochastic_rounding and not empty)
    parts = dict(rowwise_data=None, rowwise_scale_inv=None, columnwise_data=None, columnwise_scale_inv=None,
                 amax_rowwise=None, amax_columnwise=None)
    if quantizer.rowwise_usage:
        data, scales = nvfp4_quantize_rows(x2, amax_row, **kw)
        parts.update(rowwise_data=data.reshape(*shape[:-1], k // 2),
                     rowwise_scale_inv=_padded_u8(scales, quantizer.get_scale_shape(shape, columnwise=False)),
                     amax_rowwise=amax_row)
    if quantizer.columnwise_usage:
        data_t, scales_t = nvfp4_quantize_rows(col_input.contiguous(), amax_col, **kw)
        col_shape = list(quantizer.get_columnwise_shape(shape))
        col_shape[-1] //= 2
        parts.update(columnwise_data=data_t.reshape(col_shape),
                     columnwise_scale_inv=_padded_u8(scales_t, quantizer.get_scale_shape(shape, columnwise=True)),
                     amax_columnwise=amax_col)
    if output is not None:
        _store(output, parts)
        output._with_gemm_swizzled_scales = False
        return output
    Tensor, Storage = _nvfp4_classes()
    common = dict(parts, fp4_dtype=quantizer.dtype, quantizer=quantizer, with_gemm_swizzled_scales=False)
    if quantizer.internal:
        return Storage(**_accepted(Storage, {**common, "fake_dtype": x.dtype}))
    return Tensor(**_accepted(Tensor, {**common, "shape": shape, "dtype": x.dtype, "device": torch.device("cpu")}))


def _dequantize_nvfp4(t, rowwise: bool = True, otype=None) -> torch.Tensor:
    """Logical-layout values (fp32, or ``otype``) from the row-wise (or column-wise) data. Column-wise data of a
    tensor quantized with RHT holds RHT(x^T): GEMMs that contract it with another RHT'd operand get the true
    product back (the transform is orthogonal)."""
    if getattr(t, "_with_gemm_swizzled_scales", False):
        raise NotImplementedError("NVFP4 tensor with GEMM-swizzled scales: the CPU rehearsal keeps scales compact")
    if rowwise:
        if t._rowwise_data is None:
            raise NotImplementedError("Dequantizing column-wise NVFP4 data is not implemented yet!")
        packed = t._rowwise_data
        out = nvfp4_dequantize_rows(packed.reshape(-1, packed.shape[-1]), t._rowwise_scale_inv, t._amax_rowwise)
        out = out.reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    else:
        packed_t = t._columnwise_data
        first = packed_t.shape[0]
        values_t = nvfp4_dequantize_rows(packed_t.reshape(first, -1), t._columnwise_scale_inv, t._amax_columnwise)
        rest = list(packed_t.shape[1:])
        rest[-1] *= 2
        out = values_t.t().reshape(*rest, first)
    return out if otype is None else out.to(otype)


def nvfp4_data_transpose(input, out=None):
    """Packed [M, K/2] -> packed [K, M/2] (transpose.cpp nvfp4_data_transpose)."""
    m = input.shape[0]
    if m % 2:
        raise RuntimeError(f"NVFP4 transpose requires M ({m}) to be even.")
    result = pack_fp4(unpack_fp4(input.reshape(m, -1)).t().contiguous())
    if out is None:
        return result
    out.copy_(result.reshape(out.shape))
    return out


def nvfp4_2d_scale_transpose(input, output, M_tiles, K_tiles):
    """``nvfp4_scale_transpose_kernel``: output[k_tile * 16 + i, m_tile] = input[m_tile * 16, k_tile]; rows past
    the K tiles are 0."""
    k_padded = output.shape[0]
    rows = torch.arange(k_padded)
    k_tile = rows // NVFP4_BLOCK
    valid = k_tile < K_tiles
    src = input[torch.arange(M_tiles) * NVFP4_BLOCK][:, k_tile.clamp(max=max(K_tiles - 1, 0))].t()  # [K_padded, M_tiles]
    output[:, :M_tiles] = torch.where(valid[:, None], src, torch.zeros_like(src))


def quantize(tensor, quantizer, output=None, noop=None):
    empty = tensor.numel() == 0
    if empty or (noop is not None and float(noop.reshape(-1)[0]) != 0.0):
        # TE allocates the output (cast.cpp: quantizer.create_tensor) and its kernels return untouched: on the no-op
        # flag, and before any amax update or all-reduce for an empty input (quantizer.cpp: every
        # ``quantize_impl`` returns on ``numel() == 0``) — so a rank with no tokens issues no collective.
        if output is None:
            output = create_empty_quantized_tensor(quantizer, list(tensor.shape), tensor.dtype, tensor.device, False)
        return output
    kind = _quantizer_kind(quantizer)
    _STATS[f"quantize_{kind}"] += 1
    x = tensor.contiguous()
    if kind == "MXFP8Quantizer":
        return _quantize_mxfp8(x, quantizer, output)
    if kind == "Float8BlockQuantizer":
        return _quantize_block_fp8(x, quantizer, output)
    if kind == "NVFP4Quantizer":
        return _quantize_nvfp4(x, quantizer, output)
    scale = _scale_for(quantizer, x)
    with_data, with_transpose = _usages(quantizer)
    bits = cast_to_fp8(x, scale, quantizer.dtype)
    scale_inv = torch.reciprocal(scale)
    if output is None:
        return _make_float8(
            quantizer,
            x.shape,
            x.dtype,
            bits if with_data else None,
            _transpose_bits(bits) if with_transpose else None,
            scale_inv,
        )
    # Update in place (convert_and_update_tensor + cast kernel): usages follow the quantizer.
    if with_data:
        if output._data is None:
            output._data = bits
        else:
            output._data.copy_(bits.reshape(output._data.shape))
    else:
        output._data = None
    if with_transpose:
        t = _transpose_bits(bits)
        if output._transpose is None or output._transpose.shape != t.shape:
            output._transpose = t
        else:
            output._transpose.copy_(t)
        output._transpose_invalid = False
    else:
        output._transpose = None
        output._transpose_invalid = True
    if output._scale_inv is None:
        output._scale_inv = scale_inv
    else:
        output._scale_inv.copy_(scale_inv.reshape(output._scale_inv.shape))
    return output


def _logical_bits(t, rowwise: bool, who: str) -> torch.Tensor:
    """FP8 bits of ``t`` in logical layout, from the usage a GEMM operand needs (as cuBLAS)."""
    if rowwise or _non_tn_supported():
        if t._data is None:
            raise RuntimeError(f"{who}: FP8 tensor has no row-wise data, which this GEMM layout needs")
        return t._data
    if t._transpose is None or getattr(t, "_transpose_invalid", False):
        raise RuntimeError(f"{who}: FP8 tensor has no valid column-wise (transposed) data, which "
                           "this GEMM layout needs on Hopper")
    return _untranspose(t._transpose)


def _dequantize_float8(t, rowwise: bool = True, who: str = "dequantize") -> torch.Tensor:
    if t._data is None and rowwise:
        rowwise = False
    bits = _logical_bits(t, rowwise, who)
    return fp8_bits_to_float(bits, t._fp8_dtype) * t._scale_inv.float().reshape(())


def dequantize(input, otype):
    if _is_mxfp8(input):
        return _dequantize_mxfp8(input).to(_torch_dtype(otype))
    if _is_block_fp8(input):
        return _dequantize_block_fp8(input).to(_torch_dtype(otype))
    if _is_nvfp4(input):
        return _dequantize_nvfp4(input, otype=_torch_dtype(otype))
    if not _is_float8(input):
        raise NotImplementedError(
            f"transformer_engine_torch.dequantize of {type(input).__name__}: not implemented by the "
            "CPU rehearsal"
        )
    return _dequantize_float8(input).to(_torch_dtype(otype))


def create_empty_quantized_tensor(quantizer, shape, dtype, device, pin_memory):
    kind = _quantizer_kind(quantizer)
    if kind == "MXFP8Quantizer":
        return _quantize_mxfp8(torch.zeros(list(shape), dtype=dtype), quantizer)
    if kind == "Float8BlockQuantizer":
        return _quantize_block_fp8(torch.zeros(list(shape), dtype=dtype), quantizer)
    if kind == "NVFP4Quantizer":
        return _quantize_nvfp4(torch.zeros(list(shape), dtype=dtype), quantizer, empty=True)
    with_data, with_transpose = _usages(quantizer)
    shape = list(shape)
    return _make_float8(
        quantizer,
        shape,
        dtype,
        torch.empty(shape, dtype=torch.uint8) if with_data else None,
        torch.empty(_transpose_shape(shape), dtype=torch.uint8) if with_transpose else None,
        torch.empty(1, dtype=torch.float32),
    )


def fp8_transpose(input, dtype, *, out=None):
    t = _transpose_bits(input)
    if out is None:
        return t
    out.copy_(t.reshape(out.shape))
    return out


def swap_first_dims(tensor, out=None):
    """[d0, d1, ...] -> [d1, d0, ...] (transpose.cpp; TE's all-gathers of block-scaled and NVFP4 data use it to
    undo the interleaving of gathered transposed buffers)."""
    result = tensor.contiguous().transpose(0, 1).contiguous()
    if out is None:
        return result
    out.copy_(result.reshape(out.shape))
    return out


def compute_amax(input, amax):
    amax.copy_(amax_of(input).reshape(amax.shape))


def bgrad_quantize(input, quantizer):
    x = input.contiguous()
    grad_bias = x.reshape(-1, x.shape[-1]).float().sum(0).to(x.dtype)
    if quantizer is None:
        return [grad_bias, x]
    return [grad_bias, quantize(x, quantizer)]


# --------------------------------------------------------------------------------------------------
# GEMM


def _fake_dtype(t) -> torch.dtype:
    return t.dtype if isinstance(t, torch.Tensor) else getattr(t, "_dtype", torch.float32)


def _operand(t, trans_needs_rowwise: bool, who: str):
    """(fp32 2-D logical matrix, is_fp8, fake dtype, logical shape)."""
    if _is_mxfp8(t):
        x = _dequantize_mxfp8(t, rowwise=trans_needs_rowwise, who=who)
        return x.reshape(-1, x.shape[-1]), True, _fake_dtype(t), tuple(x.shape)
    if _is_block_fp8(t) or _is_nvfp4(t):
        # cuBLAS' TN-only layouts (cublaslt_gemm.cu CanonicalizeGemmInput): the operand's row-wise data
        # when the GEMM reads it transposed, else its column-wise data; never a fallback to the other.
        usage = "_rowwise_data" if trans_needs_rowwise else "_columnwise_data"
        if getattr(t, usage) is None:
            raise RuntimeError(f"{who}: Input {who[-1]} is missing "
                               f"{'row-wise' if trans_needs_rowwise else 'column-wise'} usage")
        if _is_block_fp8(t):
            x = _dequantize_block_fp8(t, rowwise=trans_needs_rowwise)
        else:
            x = _dequantize_nvfp4(t, rowwise=trans_needs_rowwise)
        return x.reshape(-1, x.shape[-1]), True, _fake_dtype(t), tuple(x.shape)
    if _is_float8(t):
        x = _dequantize_float8(t, rowwise=trans_needs_rowwise, who=who)
        return x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1), True, _fake_dtype(t), tuple(x.shape)
    if hasattr(t, "_quantizer") or type(t).__name__.endswith(("Tensor", "Storage")) and not isinstance(
        t, torch.Tensor
    ):
        raise NotImplementedError(
            f"transformer_engine_torch.generic_gemm with {type(t).__name__}: not implemented by the "
            "CPU rehearsal"
        )
    return t.float().reshape(-1, t.shape[-1]), False, t.dtype, tuple(t.shape)


def _gelu(x):
    return torch.nn.functional.gelu(x, approximate="tanh")


def _dgelu(x):
    x = x.detach().requires_grad_(True)
    with torch.enable_grad():
        (g,) = torch.autograd.grad(_gelu(x).sum(), x)
    return g


# Hopper's FP8 fast accumulation (cuBLASLt CUBLASLT_MATMUL_DESC_FAST_ACCUM, which TE sets for an FP8 GEMM when
# use_split_accumulator is False: cublaslt_gemm.cu ``fastAccuMode = use_split_accumulator ? 0 : use_fp8``), as a
# model: opt-in with ACCEL_FP8_FIX_REHEARSAL_FAST_ACCUM=1 (docs/rehearsal.md, "GPU-shaped answers").
ENV_FAST_ACCUM = "ACCEL_FP8_FIX_REHEARSAL_FAST_ACCUM"
FAST_ACCUM_MANTISSA_BITS = 13  # e8m13: "around 14 bits" (DeepSeek-V3 §3.3.2), FP22 accumulator reports on H100
FAST_ACCUM_K_CHUNK = 32  # K of one Hopper FP8 wgmma instruction (m64nNk32)


def fast_accum_enabled() -> bool:
    value = os.environ.get(ENV_FAST_ACCUM, "").strip()
    if value in ("", "0"):
        return False
    if value == "1":
        return True
    raise ValueError(f"{ENV_FAST_ACCUM}={value!r}: expected one of ['0', '1']")


def truncate_mantissa(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``x`` (float64) with its significand cut to 1 + ``bits`` bits, toward zero; 0, inf and NaN kept."""
    m, e = torch.frexp(x)  # x = m * 2**e, 0.5 <= |m| < 1
    kept = torch.ldexp(torch.trunc(torch.ldexp(m, torch.tensor(bits + 1))), e - (bits + 1))
    return torch.where(torch.isfinite(x), kept, x)


def fast_accum_matmul(x: torch.Tensor, y: torch.Tensor, bits: int = FAST_ACCUM_MANTISSA_BITS,
                      chunk: int = FAST_ACCUM_K_CHUNK) -> torch.Tensor:
    """x [M, K] @ y [K, N] of FP8 values (unscaled) with one reduced-precision accumulator along K: per
    ``chunk`` of K (one wgmma) the products and the running sum are added exactly, then the sum is truncated to
    1 + ``bits`` significant bits. Never promoted to fp32 (that is what split accumulation adds). fp32 result."""
    x64, y64 = x.double(), y.double()
    acc = torch.zeros(x.shape[0], y.shape[1], dtype=torch.float64)
    for k0 in range(0, x.shape[1], chunk):
        acc = truncate_mantissa(acc + x64[:, k0:k0 + chunk] @ y64[k0:k0 + chunk], bits)
    return acc.float()


def _fast_accum_operand(t, trans_needs_rowwise: bool, who: str):
    """(unscaled FP8 values as a 2-D fp32 matrix, scale_inv) of a per-tensor-scaled FP8 operand."""
    rowwise = trans_needs_rowwise and t._data is not None
    bits = _logical_bits(t, rowwise, who)
    values = fp8_bits_to_float(bits, t._fp8_dtype)
    return values.reshape(-1, values.shape[-1]) if values.dim() else values.reshape(1, 1), t._scale_inv.float()


def _uses_fast_accum(A, B, use_split_accumulator) -> bool:
    """Modelled where it happens: FP8 x FP8 with per-tensor scales (delayed / current scaling) on Hopper, the
    GEMM TE runs with use_split_accumulator=False (fprop: ``_2X_ACC_FPROP``,
    ``Float8CurrentScaling.fp8_gemm_fprop``)."""
    if use_split_accumulator or not fast_accum_enabled():
        return False
    plain = [_is_float8(t) and not (_is_mxfp8(t) or _is_block_fp8(t) or _is_nvfp4(t)) for t in (A, B)]
    return all(plain) and cuda_as_cpu.capability()[0] == 9


# TF32: TE runs a GEMM whose A, B and D are all fp32 with CUBLAS_COMPUTE_32F_FAST_TF32 (cublaslt_gemm.cu,
# "Use TF32 only for pure FP32 GEMM": the same lines from TE's first release to 2.20.x, TE main d0067d0 / v2.18
# read). On a GPU with TF32 tensor cores (capability >= 8.0) cuBLAS rounds both operands to TF32 (fp32's 8-bit
# exponent, 10 of its 23 fraction bits) and accumulates in fp32; below 8.0 the compute type runs plain fp32.
# cuBLAS does not document its rounding of the operands: CUDA's conversion instruction (cvt.rna.tf32.f32) rounds to
# nearest, ties away from zero ("rna", the default here); the GPU kit's fp32 GEMM fixture decides (docs/gpu.md).
ENV_TF32 = "ACCEL_FP8_FIX_REHEARSAL_TF32"
TF32_MODES = ("auto", "rna", "truncate", "off")  # auto: rna where the target's capability >= 8.0, else off
TF32_FRACTION_BITS = 10
TF32_UNIT_ROUNDOFF = {"rna": 2.0 ** -(TF32_FRACTION_BITS + 1), "truncate": 2.0 ** -TF32_FRACTION_BITS}


def tf32_mode() -> str:
    """The rounding the shim applies to the operands of an all-fp32 GEMM now: "rna", "truncate" or "off"."""
    value = os.environ.get(ENV_TF32, "").strip() or "auto"
    if value not in TF32_MODES:
        raise ValueError(f"{ENV_TF32}={value!r}: expected one of {list(TF32_MODES)}")
    if value == "auto":
        return "rna" if cuda_as_cpu.capability() >= (8, 0) else "off"
    return value


def round_to_tf32(x: torch.Tensor, mode: str = "rna") -> torch.Tensor:
    """fp32 ``x`` with its significand cut to TF32's 10 fraction bits: to nearest, ties away from zero ("rna",
    cvt.rna.tf32.f32), or toward zero ("truncate"); inf and NaN kept. fp32 result."""
    if mode == "off":
        return x
    drop = (1 << (23 - TF32_FRACTION_BITS)) - 1  # the 13 low fraction bits
    bits = x.contiguous().view(torch.int32)
    if mode == "rna":  # sign-magnitude: adding half an ulp to the magnitude rounds ties away from zero
        bits = bits + (drop + 1) // 2
    elif mode != "truncate":
        raise ValueError(f"round_to_tf32: mode {mode!r} not in ('rna', 'truncate', 'off')")
    rounded = (bits & ~drop).view(torch.float32)
    return torch.where(torch.isfinite(x), rounded, x)


def _uses_tf32(a_dtype, b_dtype, d_dtype) -> str:
    """The TF32 rounding of this GEMM's operands ("off" unless A, B and D are all fp32)."""
    if not (a_dtype == b_dtype == d_dtype == torch.float32):
        return "off"
    return tf32_mode()


def _check_gemm_output(D, expected: list, output_dtype, accumulate: bool, beta) -> None:
    """TE's checks of ``D`` and ``beta`` (pytorch/csrc/extensions/gemm.cpp ``gemm``), with its messages: what a GPU
    refuses is refused here (the shim would otherwise copy a wrong-shaped ``D`` of equal size, or ignore beta)."""
    if not accumulate and beta not in (None, 0.0):
        raise RuntimeError("Trying to use non-zero beta while not accumulating into D tensor. "
                           "Beta has nothing to be applied to.")
    if D is None:
        return
    got = list(D.shape)
    if got != list(expected):
        raise RuntimeError(f"GEMM output has invalid dims (expected ({','.join(map(str, expected))}), "
                           f"got ({','.join(map(str, got))}))")
    if output_dtype is not None and not (_is_float8(D) or _is_mxfp8(D) or _is_block_fp8(D) or _is_nvfp4(D)):
        wanted = _TE_OF[output_dtype] if isinstance(output_dtype, torch.dtype) else int(output_dtype)
        found = _TE_OF.get(D.dtype)
        if found is None or found != wanted:
            raise RuntimeError(f"GEMM output has invalid dtype (expected {wanted}, "
                               f"found {int(found) if found is not None else D.dtype})")


def _is_quantized(t) -> bool:
    return _is_float8(t) or _is_mxfp8(t) or _is_block_fp8(t) or _is_nvfp4(t)


def _logical_dims(t) -> list:
    """The logical shape of a GEMM operand: a tensor's, a quantized storage's ``size()``, else (a bare per-tensor
    FP8 holder) its row-wise data's or its transpose's, un-transposed."""
    if isinstance(t, torch.Tensor) and not _is_quantized(t):
        return list(t.shape)
    if callable(getattr(t, "size", None)):
        return list(t.size())
    if getattr(t, "_data", None) is not None:
        return list(t._data.shape)
    shape_t = list(t._transpose.shape)  # [last, *rest]
    return shape_t[1:] + shape_t[:1]


def _numel(t) -> int:
    return math.prod(_logical_dims(t))


def _refuse_strided(op: str, name: str, t) -> None:
    """The rehearsal's own refusal (TE has none): TE's extension wraps a plain tensor by ``data_ptr()`` and sizes,
    never its strides (pytorch/csrc/common.cpp:134-146, ``makeTransformerEngineTensor``: its ``.contiguous()`` is
    commented out, 137-140), so cuBLAS reads a strided tensor as if it were row-major: on a GPU the GEMM silently
    uses other elements. Computing the right answer here would hide that; the rehearsal refuses instead."""
    if t is None or not isinstance(t, torch.Tensor) or _is_quantized(t) or t.is_contiguous():
        return
    raise RuntimeError(
        f"{op} {name}: a non-contiguous tensor (shape {list(t.shape)}, strides {tuple(t.stride())}) refused by the "
        f"CPU rehearsal (accel_fp8_fix.rehearsal.te_on_cpu): TE's extension hands cuBLAS its data_ptr as a "
        f"row-major {list(t.shape)} matrix and ignores the strides (transformer_engine/pytorch/csrc/common.cpp:134-146"
        "), so a GPU would compute with other elements than these, silently; pass a contiguous tensor "
        "(.contiguous())")


def _scaling_mode(t) -> NVTEScalingMode:
    """The NVTEScalingMode TE's tensor wrapper gives ``t`` (pytorch/csrc/type_converters.cpp); an unquantized
    tensor has its NoneQuantizer's NVTE_DELAYED_TENSOR_SCALING, as a per-tensor (delayed / current) FP8 one."""
    if _is_nvfp4(t):
        return NVTEScalingMode.NVTE_NVFP4_1D_SCALING
    if _is_block_fp8(t):
        return NVTEScalingMode.NVTE_BLOCK_SCALING_2D if t._is_2D_scaled else NVTEScalingMode.NVTE_BLOCK_SCALING_1D
    if _is_mxfp8(t):
        return NVTEScalingMode.NVTE_MXFP8_1D_SCALING
    return NVTEScalingMode.NVTE_DELAYED_TENSOR_SCALING


_BLOCK_MODES = (NVTEScalingMode.NVTE_BLOCK_SCALING_1D, NVTEScalingMode.NVTE_BLOCK_SCALING_2D)


def _check_scaling_modes(A, B) -> None:
    """TE's refusal of operands with incompatible scaling modes, with its messages.

    - sm100 and newer emulate FP8 block scaling with MXFP8: gemm.cpp:314-319 converts both operands as soon as one
      is block-scaled, and the conversion refuses any other (swizzle.cpp:307-308);
    - then ``CanonicalizeGemmInput`` (common/gemm/cublaslt_gemm.cu:107-111): A and B must have the same scaling
      mode, FP8 block scaling 1-D with 2-D excepted."""
    a, b = _scaling_mode(A), _scaling_mode(B)
    if cuda_as_cpu.capability() >= (10, 0) and (a in _BLOCK_MODES or b in _BLOCK_MODES):
        if not (a in _BLOCK_MODES and b in _BLOCK_MODES):
            raise RuntimeError("Input tensor must be a block scaling tensor")
        return
    if a == b or (a in _BLOCK_MODES and b in _BLOCK_MODES):
        return
    raise RuntimeError(f"Inputs A and B to GEMM need to have compatible scaling modes, but got A.scaling_mode = "
                       f"{a.name}, B.scaling_mode = {b.name}")


def _per_tensor_ld(t, ld_row: int, ld_col: int, tn_reads_col: bool, k: int):
    """The leading dimension ``CanonicalizeGemmInput`` gives a per-tensor FP8 operand (cublaslt_gemm.cu:127-156
    for A, :219-247 for B), or None where the data it reads is missing (TE then refuses the missing usage; the
    rehearsal's ``_operand`` does). ``ld_row``: the ld of its row-wise data in this layout; ``ld_col``: of its
    column-wise data read with the mirrored flag; ``tn_reads_col``: the layout for which a TN-only GPU reads the
    transposed data."""
    has_row = t._data is not None
    has_col = t._transpose is not None and not getattr(t, "_transpose_invalid", False)
    if not _non_tn_supported():  # TN only: row-wise data transposed, or the transpose: either way ld = k
        return k if (has_col if tn_reads_col else has_row) else None
    if has_row:
        return ld_row
    return ld_col if has_col else None


def _check_fp8_leading_dims(A, transA: bool, B, transB: bool) -> None:
    """cuBLASLt's FP8 leading-dimension rule as TE checks it, with its messages (common/gemm/cublaslt_gemm.cu):
    for a per-tensor-scaled (delayed / current) FP8 A, lda % 16 == 0 (:159-163), then ldb % 16 == 0 (:250-254;
    TE tests A's type there, so B is checked only when A is FP8). lda / ldb as ``CanonicalizeGemmInput`` sets
    them: on TN-only FP8 GPUs (sm89, sm90, sm120: ``nvte_is_non_tn_fp8_gemm_supported``, transformer_engine.cpp:
    1191-1203) both are k; on sm100 (any layout) lda = k for a transposed A, else m, and ldb = n for a transposed
    B, else k (mirrored when only column-wise data is held). Block scaling has its own rule
    (``_check_block_gemm``); MXFP8 and NVFP4 operands are not checked there."""
    if not _is_float8(A) or _scaling_mode(A) != NVTEScalingMode.NVTE_DELAYED_TENSOR_SCALING:
        return
    a0, a1 = _flat_2d(_logical_dims(A))
    b0, b1 = _flat_2d(_logical_dims(B))
    m, k, n = (a0 if transA else a1), (a1 if transA else a0), (b1 if transB else b0)
    lda = _per_tensor_ld(A, k if transA else m, m if transA else k, not transA, k)
    if lda is None:
        return
    if lda % 16:
        raise RuntimeError("Leading dimension requirement on A for FP8 GEMM. Caller must pad.")
    if _is_float8(B):
        ldb = _per_tensor_ld(B, n if transB else k, k if transB else n, transB, k)
    else:
        ldb = n if transB else k  # an unquantized B (the rehearsal refuses the mixed GEMM after)
    if ldb is not None and ldb % 16:
        raise RuntimeError("Leading dimension requirement on B for FP8 GEMM. Caller must pad.")


def generic_gemm(A, transA, B, transB, D, quantizer, output_dtype, bias, bias_type, gelu, gelu_in,
                 grad, workspace, workspace_size, accumulate, use_split_accumulator,
                 comm_overlap=None, comm_type=None, extra_output=None, bulk_overlap=False,
                 alpha=1.0, beta=None):
    """D = alpha * op(B) @ op(A) [+ beta * D] with TE's epilogues (row-major view of cuBLAS' TN GEMM)."""
    if comm_overlap is not None:
        raise NotImplementedError("transformer_engine_torch.generic_gemm with comm_overlap "
                                  "(userbuffers): not implemented by the CPU rehearsal")
    for name, t in (("operand A", A), ("operand B", B), ("output D", D)):
        _refuse_strided("generic_gemm", name, t)
    if _numel(A) and _numel(B):  # gemm.cpp:303: an empty operand launches no GEMM (the output is zeroed)
        _check_scaling_modes(A, B)
        _check_fp8_leading_dims(A, transA, B, transB)
    a, a_fp8, a_dtype, _ = _operand(A, transA, "generic_gemm operand A")
    b, b_fp8, b_dtype, b_shape = _operand(B, not transB, "generic_gemm operand B")
    if a_fp8 != b_fp8:
        raise RuntimeError("generic_gemm: FP8 and non-FP8 operands cannot be mixed in one GEMM")
    _check_block_gemm(A, transA, B, transB)
    kind = "fp8_gemms" if a_fp8 else "non_fp8_gemms"  # fp8_gemms: every quantized GEMM (FP8 and NVFP4)
    _STATS[kind] += 1
    _STATS[kind + ("_bwd" if cuda_as_cpu.in_backward() else "_fwd")] += 1
    if _is_nvfp4(A) or _is_block_fp8(A):
        _STATS["nvfp4_gemms" if _is_nvfp4(A) else "fp8_block_gemms"] += 1
    op_a = a.t() if transA else a
    op_b = b.t() if transB else b
    if op_b.shape[1] != op_a.shape[0]:
        raise RuntimeError(f"generic_gemm: shapes {tuple(op_b.shape)} x {tuple(op_a.shape)} do not match")
    if _uses_fast_accum(A, B, use_split_accumulator):
        raw_a, scale_a = _fast_accum_operand(A, transA, "generic_gemm operand A")
        raw_b, scale_b = _fast_accum_operand(B, not transB, "generic_gemm operand B")
        out = fast_accum_matmul(raw_b.t() if transB else raw_b, raw_a.t() if transA else raw_a)
        out = out * (scale_a * scale_b).reshape(())  # cuBLAS' epilogue: scale_inv_A * scale_inv_B in fp32
        _STATS["fast_accum_gemms"] += 1
    else:
        d_dtype = D.dtype if D is not None else (
            None if quantizer is not None else
            _torch_dtype(output_dtype) if output_dtype is not None else b_dtype)
        tf32 = "off" if a_fp8 else _uses_tf32(a_dtype, b_dtype, d_dtype)
        if tf32 != "off":
            op_a, op_b = round_to_tf32(op_a, tf32), round_to_tf32(op_b, tf32)
            _STATS["tf32_gemms"] += 1
        out = op_b @ op_a
    if alpha != 1.0:
        out = out * alpha
    n = out.shape[1]
    out_shape = [*b_shape[:-1], n] if not transB else [out.shape[0], n]
    _check_gemm_output(D, out_shape, output_dtype, accumulate, beta)

    bias_grad = None
    gelu_input = None
    if grad:
        if bias is not None:
            bias_grad = b.sum(0).to(_torch_dtype(bias_type))
        if gelu:
            out = out * _dgelu(gelu_in.float().reshape(out.shape))
    else:
        if bias is not None:
            out = out + bias.float()
        if gelu:
            gelu_input = out.to(_torch_dtype(output_dtype) if output_dtype is not None else b_dtype)
            gelu_input = gelu_input.reshape(out_shape)
            out = _gelu(out)

    if D is not None:
        if accumulate:
            prev = D.float().reshape(out.shape)
            out = out + (prev if beta in (None, 1.0) else prev * beta)
        D.copy_(out.reshape(D.shape).to(D.dtype))
        result = D
    elif quantizer is not None:
        result = quantize(out.reshape(out_shape), quantizer)
    else:
        otype = _torch_dtype(output_dtype) if output_dtype is not None else (b_dtype if not b_fp8 else torch.float32)
        result = out.reshape(out_shape).to(otype)
    return [result, bias_grad, gelu_input, extra_output]


# --------------------------------------------------------------------------------------------------
# Normalization (fp32 statistics, fused quantize of the output)


def _norm_output(y32, ln_out, quantizer, otype):
    if ln_out is not None:
        if _is_float8(ln_out) or _is_mxfp8(ln_out) or _is_block_fp8(ln_out) or _is_nvfp4(ln_out):
            return quantize(y32, quantizer if quantizer is not None else ln_out._quantizer, ln_out)
        ln_out.copy_(y32.reshape(ln_out.shape).to(ln_out.dtype))
        return ln_out
    if quantizer is not None:
        kind = _quantizer_kind(quantizer)
        # FP8 delayed scaling: fully fused, cast from fp32; current scaling / MXFP8: norm in out dtype, then cast.
        src = y32 if kind == "Float8Quantizer" else y32.to(_torch_dtype(otype))
        return quantize(src, quantizer)
    return y32.to(_torch_dtype(otype))


def _gamma(weight, zero_centered_gamma):
    w = weight.float()
    return w + 1.0 if zero_centered_gamma else w


def layernorm_fwd(input, weight, bias, eps, ln_out, quantizer, otype, sm_margin, zero_centered_gamma):
    x = input.float().reshape(-1, input.shape[-1])
    mu = x.mean(-1)
    var = ((x - mu[:, None]) ** 2).mean(-1)
    rsigma = torch.rsqrt(var + eps)
    y = (x - mu[:, None]) * rsigma[:, None] * _gamma(weight, zero_centered_gamma)
    if bias is not None:
        y = y + bias.float()
    y = y.reshape(input.shape)
    return [_norm_output(y, ln_out, quantizer, otype), mu, rsigma]


def rmsnorm_fwd(input, weight, eps, ln_out, quantizer, otype, sm_margin, zero_centered_gamma):
    x = input.float().reshape(-1, input.shape[-1])
    rsigma = torch.rsqrt((x * x).mean(-1) + eps)
    y = (x * rsigma[:, None] * _gamma(weight, zero_centered_gamma)).reshape(input.shape)
    return [_norm_output(y, ln_out, quantizer, otype), None, rsigma]


def layernorm_bwd(dz, x, mu, rsigma, gamma, sm_margin, zero_centered_gamma):
    x2 = x.float().reshape(-1, x.shape[-1])
    dz2 = dz.float().reshape(x2.shape)
    xhat = (x2 - mu.float()[:, None]) * rsigma.float()[:, None]
    dxhat = dz2 * _gamma(gamma, zero_centered_gamma)
    dx = rsigma.float()[:, None] * (
        dxhat - dxhat.mean(-1, keepdim=True) - xhat * (dxhat * xhat).mean(-1, keepdim=True)
    )
    dgamma = (dz2 * xhat).sum(0)
    dbeta = dz2.sum(0)
    return [dx.reshape(x.shape).to(x.dtype), dgamma.to(gamma.dtype), dbeta.to(gamma.dtype)]


def rmsnorm_bwd(dz, x, rsigma, gamma, sm_margin, zero_centered_gamma):
    x2 = x.float().reshape(-1, x.shape[-1])
    dz2 = dz.float().reshape(x2.shape)
    xhat = x2 * rsigma.float()[:, None]
    dxhat = dz2 * _gamma(gamma, zero_centered_gamma)
    dx = rsigma.float()[:, None] * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True))
    dgamma = (dz2 * xhat).sum(0)
    return [dx.reshape(x.shape).to(x.dtype), dgamma.to(gamma.dtype)]


# --------------------------------------------------------------------------------------------------
# Activations (LayerNormMLP): high-precision output, or quantized by the given quantizer


def _act_out(y32, quantizer, like):
    if quantizer is None:
        return y32.to(like.dtype)
    return quantize(y32.to(like.dtype), quantizer)


def gelu(input, quantizer):
    return _act_out(_gelu(input.float()), quantizer, input)


def dgelu(grad, fwd_input, quantizer):
    return _act_out(grad.float() * _dgelu(fwd_input.float()), quantizer, grad)


def relu(input, quantizer):
    return _act_out(torch.relu(input.float()), quantizer, input)


def drelu(grad, fwd_input, quantizer):
    return _act_out(grad.float() * (fwd_input.float() > 0).float(), quantizer, grad)


def silu(input, quantizer):
    return _act_out(torch.nn.functional.silu(input.float()), quantizer, input)


def swiglu(input, quantizer):
    a, b = input.float().chunk(2, dim=-1)
    return _act_out(torch.nn.functional.silu(a) * b, quantizer, input)


def dswiglu(grad, fwd_input, quantizer):
    a, b = fwd_input.float().detach().chunk(2, dim=-1)
    a.requires_grad_(True)
    b.requires_grad_(True)
    with torch.enable_grad():
        y = torch.nn.functional.silu(a) * b
        da, db = torch.autograd.grad(y, (a, b), grad.float())
    return _act_out(torch.cat([da, db], dim=-1), quantizer, grad)


def dbias_dgelu(grad, fwd_input, quantizer):
    dact = grad.float() * _dgelu(fwd_input.float())
    grad_bias = dact.reshape(-1, dact.shape[-1]).sum(0).to(grad.dtype)
    return [grad_bias, _act_out(dact, quantizer, grad)]


# --------------------------------------------------------------------------------------------------
# Delayed-scaling update and multi-tensor ops


def fused_amax_and_scale_update_after_reduction(amax_reduction_buffer, amax_histories, scales,
                                                amax_compute_algo, fp8_dtype, margin):
    """``delayed_scaling.cu`` ``kernel_bulk``, per scale slot:

    last = reduced amax if non-zero, else history[0]. Only if last != 0: roll (h[i] = h[i+1],
    h[-1] = last, h[0] = 0). amax = max over the rolled window ("max", NaN ignored) or last
    ("most_recent"). scale = (fp8_max / 2**margin) / amax when amax is finite and > 0, else the old
    scale; an infinite scale becomes FLT_MAX.
    """
    _STATS["scale_updates"] += 1
    _, fp8_max = _fp8_info(fp8_dtype)
    scaled_max = torch.tensor(fp8_max, dtype=torch.float32) / (2.0 ** margin)
    # the kernel's threads, one scale slot each: every slot of every history at once (a [length, slots] matrix),
    # in as few torch calls as the layout allows — per-call costs, not arithmetic, dominate here
    histories = [h.view(h.shape[0], -1) for h in amax_histories]
    scales = [s.view(-1) for s in scales]
    if not histories:
        return
    if len({h.shape[0] for h in histories}) > 1 or len({h.dtype for h in histories + scales}) > 1:
        groups = [([h], [s]) for h, s in zip(histories, scales)]  # not TE's layout (one recipe, one length)
    else:
        groups = [(histories, scales)]
    offset = 0
    for hs, ss in groups:
        h = torch.cat(hs, dim=1) if len(hs) > 1 else hs[0].clone()
        s = torch.cat(ss) if len(ss) > 1 else ss[0].clone()
        slots = h.shape[1]
        local = h[0].float()
        if amax_reduction_buffer is None:
            last = local
        else:
            reduced = amax_reduction_buffer[offset:offset + slots].float()
            last = torch.where(reduced != 0, reduced, local)
        rolls = last != 0  # NaN too, as in the kernel
        window = torch.cat([h[1:].float(), last.unsqueeze(0)])
        if amax_compute_algo == "max":
            amax = torch.where(rolls, torch.where(torch.isnan(window), 0.0, window).amax(0).clamp_min(0.0), 0.0)
        elif amax_compute_algo == "most_recent":
            amax = last
        else:
            amax = torch.zeros_like(last)
        rolled = torch.where(rolls, torch.cat([torch.zeros_like(last).unsqueeze(0), window[1:]]), h.float())
        new = torch.where(torch.isfinite(amax) & (amax > 0), scaled_max / amax, s.float())
        new = torch.where(torch.isinf(new), torch.tensor(FLT_MAX, dtype=torch.float32), new)
        widths = [x.shape[1] for x in hs]
        torch._foreach_copy_(hs, list(rolled.to(h.dtype).split(widths, dim=1)))
        torch._foreach_copy_(ss, list(new.to(s.dtype).split(widths)))
        offset += slots


def multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale):
    src, dst = tensor_lists
    for s, d in zip(src, dst):
        v = s.float() * scale
        if not torch.isfinite(v).all():
            noop_flag.fill_(1)
        d.copy_(v.to(d.dtype))


def multi_tensor_l2norm(chunk_size, noop_flag, tensor_lists, per_tensor=False):
    tensors = tensor_lists[0]
    norms = torch.stack([t.float().norm() for t in tensors]) if tensors else torch.zeros(0)
    total = norms.norm().reshape(1) if tensors else torch.zeros(1)
    return total, (norms if per_tensor else torch.zeros(0))


def multi_tensor_compute_scale_and_scale_inv(chunk_size, noop_flag, tensor_lists, max_fp8,
                                             force_pow_2_scales=False, epsilon=0.0):
    amaxes, scales, scale_invs = tensor_lists
    for amax, scale, scale_inv in zip(amaxes, scales, scale_invs):
        s = scale_from_amax(float(amax.reshape(-1)[0]), max_fp8, force_pow_2_scales, epsilon)
        scale.fill_(s)
        scale_inv.fill_(1.0 / s)


def _swizzle_needed(tensor) -> bool:
    """swizzle.cpp: only MXFP8 / NVFP4 (1-D block scales) have a GEMM-swizzled layout; other tensors (per-tensor
    FP8, FP8 block scaling) and scales already swizzled return early, as in TE."""
    return (_is_mxfp8(tensor) or _is_nvfp4(tensor)) and not getattr(tensor, "_with_gemm_swizzled_scales", False)


def _refuse_swizzle(op: str, tensor) -> None:
    raise NotImplementedError(
        f"transformer_engine_torch.{op} of a {type(tensor).__name__} with compact scales: the CPU rehearsal keeps "
        "MXFP8 / NVFP4 scales compact (its GEMM reads them so) and does not write cuBLAS' swizzled layout")


def swizzle_scales_for_gemm_(tensor):
    """``inplace_swizzle_scale_for_gemm``: an exact no-op where TE's is one (per-tensor FP8, FP8 block scaling,
    scales already swizzled); MXFP8 / NVFP4 compact scales raise ``NotImplementedError``."""
    if _swizzle_needed(tensor):
        _refuse_swizzle("swizzle_scales_for_gemm_", tensor)


def _multi_swizzle(op: str, tensors, rowwise_usage: bool, columnwise_usage: bool) -> None:
    if rowwise_usage == columnwise_usage:
        raise RuntimeError("Expect exactly one of rowwise_usage and columnwise_usage.")
    tensors = list(tensors)
    if not tensors or not (_is_mxfp8(tensors[0]) or _is_nvfp4(tensors[0])):  # TE decides by the first one
        return
    for t in tensors:
        scales = getattr(t, "_rowwise_scale_inv" if rowwise_usage else "_columnwise_scale_inv", None)
        if _swizzle_needed(t) and scales is not None and scales.numel():
            _refuse_swizzle(op, t)


def multi_tensor_swizzle_scales_for_gemm_(tensors, rowwise_usage, columnwise_usage):
    _multi_swizzle("multi_tensor_swizzle_scales_for_gemm_", tensors, rowwise_usage, columnwise_usage)


def multi_tensor_swizzle_scales_for_gemm_unchecked_(tensors, rowwise_usage, columnwise_usage):
    _multi_swizzle("multi_tensor_swizzle_scales_for_gemm_unchecked_", tensors, rowwise_usage, columnwise_usage)


# --------------------------------------------------------------------------------------------------
# Library queries: the target machine's (target.py, ACCEL_FP8_FIX_REHEARSAL_TARGET)


def get_cublasLt_version():
    """``cublasLtGetVersion()`` of the target profile's cuBLAS (h200-cu130: 13.1.0.3 -> 130100)."""
    return target.profile().cublaslt


def get_cudnn_version():
    """``cudnnGetVersion()`` of the target profile's cuDNN (h200-cu130: 9.19.0.56 -> 91900)."""
    return target.profile().cudnn


def get_num_cublas_streams():
    return 4  # TE's compile-time number of compute streams (``num_streams``), not a hardware answer


def get_stream_priority_range():
    return target.profile().stream_priority_range


def device_supports_multicast(*args, **kwargs):
    return False  # listed in docs/rehearsal.md: only userbuffers ask, and they are not rehearsed


def ubuf_built_with_mpi():
    return False  # TE's PyPI wheels are built without NVTE_UB_WITH_MPI


def get_fused_attn_backend(*args, **kwargs):
    """No cuDNN here: TE's attention then chooses a non-fused backend (UnfusedDotProductAttention on CPU).
    Listed by name in docs/rehearsal.md; a GPU with cuDNN would answer a fused backend for most shapes."""
    return NVTE_Fused_Attn_Backend.NVTE_No_Backend
