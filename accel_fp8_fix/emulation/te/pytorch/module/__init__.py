"""Emulated ``transformer_engine.pytorch.module``."""

from .base import TransformerEngineBaseModule
from .layernorm import LayerNorm
from .layernorm_linear import LayerNormLinear
from .linear import Linear
from .rmsnorm import RMSNorm

__emulated__ = True
