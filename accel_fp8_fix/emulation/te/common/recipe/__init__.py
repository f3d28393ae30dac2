"""Emulated ``transformer_engine.common.recipe`` (checked against TE 2.20.2 common/recipe/__init__.py).

Plain ``dataclasses`` instead of pydantic dataclasses; same field names, defaults and checks for the
recipes the emulation runs (DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling); Float8BlockScaling
and NVFP4BlockScaling exist for isinstance checks and construction only.
"""

from __future__ import annotations

import abc
import os
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Literal, NamedTuple, Optional, Union

__emulated__ = True

_BACKWARD_OVERRIDES = (None, "high_precision", "dequantized")


class _FormatHelper(NamedTuple):
    """Stores max FP8 values for fprop and bprop a `Format`."""

    max_fwd: float
    max_bwd: float


class Format(Enum):
    """Supported FP8/FP4 formats (E2M1, E4M3, E5M2, HYBRID = E4M3 forward / E5M2 backward)."""

    E2M1 = _FormatHelper(max_fwd=6, max_bwd=6)
    E4M3 = _FormatHelper(max_fwd=448, max_bwd=448)
    E5M2 = _FormatHelper(max_fwd=57344, max_bwd=57344)
    HYBRID = _FormatHelper(max_fwd=E4M3.max_fwd, max_bwd=E5M2.max_bwd)


@dataclass(frozen=True)
class MMParams:
    """Matrix multiplication options."""

    use_split_accumulator: bool = True


@dataclass(frozen=True)
class QParams:
    """Quantization parameters."""

    power_2_scale: bool = False
    amax_epsilon: float = 0.0
    random_hadamard_transform: bool = False
    stochastic_rounding: bool = False
    fp4_2d_quantization: bool = False


class Recipe:
    """Base recipe class."""

    @abc.abstractmethod
    def _make_repr(self) -> str:
        """String representation."""

    def __repr__(self) -> str:
        return self._make_repr()

    @classmethod
    def nvfp4(cls):
        return issubclass(cls, NVFP4BlockScaling)

    @classmethod
    def mxfp8(cls):
        return issubclass(cls, MXFP8BlockScaling)

    @classmethod
    def delayed(cls):
        return issubclass(cls, DelayedScaling)

    @classmethod
    def float8_current_scaling(cls):
        return issubclass(cls, Float8CurrentScaling)

    @classmethod
    def float8_per_tensor_scaling(cls):
        return issubclass(cls, (DelayedScaling, Float8CurrentScaling))

    @classmethod
    def float8_block_scaling(cls):
        return issubclass(cls, Float8BlockScaling)

    @classmethod
    def custom(cls):
        return issubclass(cls, CustomRecipe)


def _check_common(self) -> None:
    assert self.fp8_format != Format.E5M2, "Pure E5M2 training is not supported."
    assert (
        self.backward_override in _BACKWARD_OVERRIDES
    ), "NVTE_BACKWARD_OVERRIDE must be unset or one of: 'high_precision', 'dequantized'."


@dataclass(repr=False)
class DelayedScaling(Recipe):
    """Delayed scaling: scale from the amax history of previous iterations.

    ``new_scaling_factor = (FP8_MAX / amax) / (2 ^ margin)``.
    """

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: Union[Literal["max", "most_recent"], Callable] = "max"
    scaling_factor_compute_algo: Optional[Callable] = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = field(default_factory=lambda: os.getenv("NVTE_BACKWARD_OVERRIDE", None))

    def __post_init__(self) -> None:
        _check_common(self)
        assert self.backward_override is None, "Delayed scaling only supports backward_override=None."

    def _make_repr(self) -> str:
        return (
            f"recipe_type={self.__class__.__name__}, "
            f"margin={self.margin}, "
            f"format={str(self.fp8_format).split('.')[1]}, "
            f"amax_history_len={self.amax_history_len}, "
            f"reduce_amax={self.reduce_amax}, "
            f"fp8_dpa={self.fp8_dpa}, "
            f"fp8_mha={self.fp8_mha}, "
            f"backward_override={self.backward_override}"
        )


_POW2 = os.getenv("NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES", "0") == "1"


@dataclass(repr=False)
class Float8CurrentScaling(Recipe):
    """Per-tensor current scaling: scale from the amax of the tensor being cast."""

    use_power_2_scales: bool = _POW2
    fp8_format: Format = Format.HYBRID
    fp8_quant_fwd_inp = QParams(power_2_scale=_POW2, amax_epsilon=0.0)
    fp8_quant_fwd_weight = QParams(power_2_scale=_POW2, amax_epsilon=0.0)
    fp8_quant_bwd_grad = QParams(power_2_scale=_POW2, amax_epsilon=0.0)
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=False)
    fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = field(default_factory=lambda: os.getenv("NVTE_BACKWARD_OVERRIDE", None))

    def __post_init__(self) -> None:
        _check_common(self)

    def _make_repr(self) -> str:
        return (
            f"recipe_type={self.__class__.__name__}, "
            f"format={str(self.fp8_format).split('.')[1]}, "
            f"fp8_quant_fwd_inp={self.fp8_quant_fwd_inp}, "
            f"fp8_quant_fwd_weight={self.fp8_quant_fwd_weight}, "
            f"fp8_quant_bwd_grad={self.fp8_quant_bwd_grad}, "
            f"fp8_dpa={self.fp8_dpa}, "
            f"fp8_mha={self.fp8_mha}, "
            f"backward_override={self.backward_override}"
        )


@dataclass(repr=False)
class MXFP8BlockScaling(Recipe):
    """MXFP8: blocks of 32 consecutive values share a power-of-two (E8M0) scale."""

    margin: int = 0
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = field(default_factory=lambda: os.getenv("NVTE_BACKWARD_OVERRIDE", None))
    enable_2d_quantization: bool = False

    def __post_init__(self) -> None:
        _check_common(self)

    def _make_repr(self) -> str:
        return (
            f"recipe_type={self.__class__.__name__}, "
            f"margin={self.margin}, "
            f"format={str(self.fp8_format).split('.')[1]}, "
            f"backward_override={self.backward_override}, "
            f"enable_2d_quantization={self.enable_2d_quantization}"
        )


@dataclass(repr=False)
class Float8BlockScaling(Recipe):
    """Block-wise FP8 scaling (constructible; not executed by the emulation)."""

    fp8_format: Format = Format.E4M3
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = field(default_factory=lambda: os.getenv("NVTE_BACKWARD_OVERRIDE", None))

    def _make_repr(self) -> str:
        return f"recipe_type={self.__class__.__name__}, format={str(self.fp8_format).split('.')[1]}"


@dataclass(repr=False)
class NVFP4BlockScaling(Recipe):
    """NVFP4 block scaling (constructible; not executed by the emulation)."""

    fp4_format: Format = Format.E2M1
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = field(default_factory=lambda: os.getenv("NVTE_BACKWARD_OVERRIDE", None))

    def _make_repr(self) -> str:
        return f"recipe_type={self.__class__.__name__}"


@dataclass(repr=False)
class CustomRecipe(Recipe):
    """Custom recipe (constructible; not executed by the emulation)."""

    qfactory: Optional[Callable[..., Any]] = None
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def _make_repr(self) -> str:
        return f"recipe_type={self.__class__.__name__}, qfactory={self.qfactory}"
