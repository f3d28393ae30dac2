"""TE's quantized tensors, for the opt-in FP8 all-gather (fixes/all_gather/fp8_all_gather.py): TE's ``Float8Tensor``
and ``Float8BlockwiseQTensor`` built from FSDP2-gathered bytes, their quantizers, their private fields read and
refilled, and what the path needs of TE's source (checked when the switch is on: :func:`fp8_all_gather_missing`).
"""

from __future__ import annotations

from collections.abc import Mapping

from .installed import te_version
from .scaling import fp8_weight_dtype

# What the opt-in FP8 all-gather needs of TE (checked at prepare when the switch is on, not when the patch set is
# applied: a TE without them refuses the switch, by name, and leaves the rest of the fixes on).
FP8_ALL_GATHER_SOURCES = (
    ("pytorch/tensor/float8_tensor.py", "class Float8Quantizer"),
    ("pytorch/tensor/float8_tensor.py", "def fsdp_post_all_gather("),  # TE's own FSDP2 layout of a gathered weight
    ("pytorch/tensor/float8_tensor.py", "torch.ops.aten.as_strided.default"),
    ("pytorch/tensor/storage/float8_tensor_storage.py", "def _create_transpose("),
    ("pytorch/tensor/storage/float8_tensor_storage.py", "_transpose_invalid"),
    ("pytorch/tensor/utils.py", "def clear_columnwise_cache("),  # TE drops the dgrad transpose under FSDP2
    ("pytorch/module/linear.py", "isinstance(weight, QuantizedTensor)"),
)
# ... and under Float8BlockScaling (2-D weight tiles, gathered row-wise; TE derives the column-wise copy)
FP8_ALL_GATHER_BLOCK_SOURCES = (
    ("pytorch/tensor/float8_blockwise_tensor.py", "class Float8BlockQuantizer"),
    ("pytorch/tensor/float8_blockwise_tensor.py", "def get_scale_shape("),
    ("pytorch/tensor/storage/float8_blockwise_tensor_storage.py", "def _create_columnwise("),
    ("pytorch/tensor/storage/float8_blockwise_tensor_storage.py", "self._rowwise_scale_inv"),
)


def fp8_all_gather_missing(versions: Mapping[str, str | None], recipe_name: str | None = None) -> list[str]:
    """What the FP8 all-gather needs of the installed TE (under ``recipe_name``) and is not there (empty: all
    there)."""
    from .. import missing_from_sources, package_root

    root = package_root("transformer_engine")
    if root is None:
        return ["transformer_engine not found"]
    sources = FP8_ALL_GATHER_SOURCES + (FP8_ALL_GATHER_BLOCK_SOURCES if recipe_name == "Float8BlockScaling" else ())
    return missing_from_sources(root, sources, f"transformer-engine {te_version(versions)}")


def float8_quantizer(scale, fp8_dtype):
    """TE's per-tensor ``Float8Quantizer`` with a given ``scale`` (row-wise usage only: column-wise data for the
    dgrad GEMM is derived from the row-wise data by TE when backward needs it)."""
    import torch
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer

    amax = torch.zeros(1, dtype=torch.float32, device=scale.device)
    return Float8Quantizer(scale=scale, amax=amax, fp8_dtype=fp8_dtype, rowwise=True, columnwise=False)


def quantized_bits(tensor):
    """The uint8 row-wise FP8 bits of a TE Float8Tensor."""
    return tensor._data


def float8_rowwise(tensor):
    """(uint8 row-wise data, fp32 scale_inv) of a TE ``Float8Tensor``."""
    return tensor._data, tensor._scale_inv


def make_float8(data, scale_inv, fp8_dtype, dtype, quantizer):
    """A TE ``Float8Tensor`` (nominal ``dtype``) on the uint8 ``data`` with ``scale_inv`` — what TE's own
    ``fsdp_post_all_gather`` builds from a gathered weight."""
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Tensor

    return Float8Tensor(shape=data.size(), dtype=dtype, fp8_scale_inv=scale_inv, fp8_dtype=fp8_dtype,
                        quantizer=quantizer, requires_grad=False, data=data, device=data.device)


def refill_float8(tensor, data, scale_inv) -> None:
    """Point an existing Float8Tensor at newly gathered ``data`` and ``scale_inv``; a transposed copy left from an
    earlier backward is dropped (stale)."""
    tensor._data = data
    tensor._scale_inv.copy_(scale_inv.reshape(tensor._scale_inv.shape))
    tensor._transpose = None
    tensor._transpose_invalid = True


def float8_block_weight_quantizer(recipe):
    """TE's ``Float8BlockQuantizer`` for a weight under ``Float8BlockScaling`` — the recipe's weight settings
    (``w_block_scaling_dim``, ``fp8_quant_fwd_weight``: power-of-2 scales, epsilon), as TE's
    ``Float8BlockScalingRecipeState`` builds it — row-wise usage only (column-wise derived by TE when needed)."""
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer

    qparams = recipe.fp8_quant_fwd_weight
    return Float8BlockQuantizer(fp8_dtype=fp8_weight_dtype(recipe), rowwise=True, columnwise=False,
                                amax_epsilon=qparams.amax_epsilon, force_pow_2_scales=qparams.power_2_scale,
                                block_scaling_dim=recipe.w_block_scaling_dim)


def block_scale_shape(quantizer, rows: int, cols: int) -> tuple:
    """The row-wise ``scale_inv`` shape TE gives a ``[rows, cols]`` block-scaled tensor (128x128 tiles:
    ``[ceil(rows/128), roundup(ceil(cols/128), 4)]``)."""
    return tuple(quantizer.get_scale_shape((rows, cols), False))


def block_rowwise(tensor):
    """(uint8 row-wise data, fp32 row-wise scale_inv) of a TE ``Float8BlockwiseQTensor``."""
    return tensor._rowwise_data, tensor._rowwise_scale_inv


def make_float8_blockwise(data, scale_inv, dtype, quantizer):
    """A 2-D-scaled TE ``Float8BlockwiseQTensor`` (nominal ``dtype``) on row-wise ``data`` and ``scale_inv`` — what
    TE's own ``fsdp_post_all_gather`` builds (column-wise data derived by TE's ``update_usage`` when backward asks)."""
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockwiseQTensor

    return Float8BlockwiseQTensor(shape=data.shape, dtype=dtype, fp8_dtype=quantizer.dtype, rowwise_data=data,
                                  rowwise_scale_inv=scale_inv, columnwise_data=None, columnwise_scale_inv=None,
                                  quantizer=quantizer, is_2D_scaled=True, device=data.device)


def refill_float8_blockwise(tensor, data, scale_inv) -> None:
    """Point an existing Float8BlockwiseQTensor at newly gathered row-wise ``data`` / ``scale_inv``; a column-wise
    copy left from an earlier backward is dropped (stale)."""
    tensor._rowwise_data = data
    tensor._rowwise_scale_inv = scale_inv
    tensor._columnwise_data = None
    tensor._columnwise_scale_inv = None
