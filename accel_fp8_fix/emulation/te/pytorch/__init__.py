"""Emulated ``transformer_engine.pytorch`` (CPU emulation by accel_fp8_fix; not real Transformer Engine).

Exports checked against TE 2.20.2 ``transformer_engine/pytorch/__init__.py`` for the names accelerate
and transformers use; attention, MLP, userbuffers, grouped GEMMs and FP8 tensors are not emulated.
"""

import torch  # noqa: F401

from accel_fp8_fix.emulation._version import DIST_VERSION as __version__  # noqa: F401

from .module import LayerNorm, LayerNormLinear, Linear, RMSNorm, TransformerEngineBaseModule  # noqa: F401
from .quantization import (  # noqa: F401
    FP8GlobalStateManager,
    autocast,
    fp8_autocast,
    fp8_model_init,
    get_default_recipe,
    is_fp8_available,
    is_fp8_block_scaling_available,
    is_mxfp8_available,
    is_nvfp4_available,
    quantized_model_init,
)
from . import quantization  # noqa: F401

__emulated__ = True


def is_bf16_available(return_reason: bool = False):
    return (True, "") if return_reason else True


def get_device_compute_capability():
    """The emulation pretends no CUDA device: (0, 0)."""
    return (0, 0)


def _not_emulated(name):
    def __init__(self, *args, **kwargs):
        raise NotImplementedError(
            f"transformer_engine.pytorch.{name} is not emulated (accel_fp8_fix CPU emulation covers "
            "Linear, LayerNormLinear, LayerNorm, RMSNorm)"
        )

    return type(name, (TransformerEngineBaseModule,), {"__init__": __init__, "__module__": __name__,
                                                       "forward": lambda self, *a, **k: None})


# Present for isinstance checks (accelerate's has_transformer_engine_layers); constructing them raises.
TransformerLayer = _not_emulated("TransformerLayer")
LayerNormMLP = _not_emulated("LayerNormMLP")
MultiheadAttention = _not_emulated("MultiheadAttention")
DotProductAttention = _not_emulated("DotProductAttention")
GroupedLinear = _not_emulated("GroupedLinear")
