"""TE's FP8 scales: the largest value of each FP8 type, a weight's FP8 type under a recipe, and TE's
``compute_scale_from_amax`` (common/recipe/recipe_common.cuh) with the settings each recipe gives it — current
scaling's ``fp8_quant_fwd_weight`` (power-of-2 scales, epsilon), the delayed recipe's ``margin``
(``fp8_max / amax / 2**margin``, as ``delayed_scaling.cu``). The package computes a weight's scale itself only for
the opt-in FP8 all-gather (fixes/all_gather/fp8_weight_record.py), bit for bit as TE's kernel does
(tests/unit/test_fp8_all_gather_units.py: values transcribed from the kernel).
"""

from __future__ import annotations

from dataclasses import dataclass

FLT_MAX = 3.4028234663852886e38  # an infinite scale becomes this (value_for_inf, fp32)


def fp8_max(fp8_dtype) -> float:
    """The largest finite value of TE's FP8 ``DType`` (E4M3 448, E5M2 57344)."""
    import torch
    import transformer_engine_torch as tex

    torch_dtype = {int(tex.DType.kFloat8E4M3): torch.float8_e4m3fn, int(tex.DType.kFloat8E5M2): torch.float8_e5m2}
    return float(torch.finfo(torch_dtype[int(fp8_dtype)]).max)


def fp8_weight_dtype(recipe):
    """TE's FP8 ``DType`` of a weight (forward tensor) under ``recipe``: E4M3 unless the format is E5M2."""
    import transformer_engine_torch as tex
    from transformer_engine.common.recipe import Format

    fmt = getattr(recipe, "fp8_format", Format.HYBRID)
    return tex.DType.kFloat8E5M2 if fmt == Format.E5M2 else tex.DType.kFloat8E4M3


@dataclass
class ScaleParams:
    fp8_dtype: object
    fp8_max: float
    margin: int = 0
    force_pow_2: bool = False
    epsilon: float = 0.0


def scale_params(recipe) -> ScaleParams:
    """The weight-scale settings of ``recipe``: current scaling's ``fp8_quant_fwd_weight`` (power-of-2, epsilon),
    the delayed recipe's ``margin``."""
    fp8_dtype = fp8_weight_dtype(recipe)
    params = ScaleParams(fp8_dtype, fp8_max(fp8_dtype))
    qparams = getattr(recipe, "fp8_quant_fwd_weight", None)
    if qparams is not None:
        params.force_pow_2 = bool(getattr(qparams, "power_2_scale", False))
        params.epsilon = float(getattr(qparams, "amax_epsilon", 0.0))
    if type(recipe).__name__ == "DelayedScaling":
        params.margin = int(getattr(recipe, "margin", 0))
    return params


def scales_from_amaxes(amax, params: ScaleParams):
    """TE's ``compute_scale_from_amax`` (common/recipe/recipe_common.cuh) over a vector, fp32; a delayed recipe's
    ``margin`` divides by ``2**margin`` (exact: a power of two)."""
    import torch

    amax = amax.float()
    amax = torch.where(amax < params.epsilon, torch.full_like(amax, params.epsilon), amax)
    scale = torch.full_like(amax, params.fp8_max) / amax
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, FLT_MAX), scale)
    if params.margin:
        scale = torch.ldexp(scale, torch.full_like(scale, -params.margin))
    bad = (amax == 0) | torch.isinf(amax) | torch.isnan(amax)
    scale = torch.where(bad, torch.ones_like(scale), scale)
    if params.force_pow_2:
        scale = (scale.view(torch.int32) & torch.tensor(0xFF800000 - (1 << 32), dtype=torch.int32)).view(torch.float32)
    return scale
