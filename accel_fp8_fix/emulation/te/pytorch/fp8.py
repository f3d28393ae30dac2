"""Emulated ``transformer_engine.pytorch.fp8`` (deprecated in TE 2.x in favour of ``quantization``)."""

import warnings

warnings.warn(
    "Using deprecated internal API from Transformer Engine. "
    "transformer_engine.pytorch.fp8 will be removed in a future release.",
    DeprecationWarning,
    stacklevel=2,
)

from ..common.recipe import (  # noqa: E402,F401
    CustomRecipe,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    Recipe,
)
from .quantization import (  # noqa: E402,F401
    FP8GlobalStateManager,
    RecipeState,
    DelayedScalingRecipeState,
    Float8CurrentScalingRecipeState,
    MXFP8BlockScalingRecipeState,
    _amax_and_scale_update,
    _compute_amax_and_update_history,
    _compute_scaling_factor,
    _default_get_amax_and_update_history,
    _default_sf_compute,
    _update_amax_history,
    check_fp8_block_scaling_support,
    check_fp8_support,
    check_mxfp8_support,
    check_nvfp4_support,
    check_recipe_support,
    fp8_autocast,
    fp8_model_init,
    get_default_fp8_recipe,
    get_fp8_max,
    get_fp8_te_dtype,
    get_fp8_torch_dtype,
    split_and_copy,
)

__emulated__ = True
