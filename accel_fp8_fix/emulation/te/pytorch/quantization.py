"""Emulated ``transformer_engine.pytorch.quantization`` (checked against TE 2.20.2 quantization.py).

Global FP8 state, ``autocast`` / ``fp8_autocast``, ``quantized_model_init`` / ``fp8_model_init``, recipe
states and the DelayedScaling amax reduction + scale update, with TE's formulas. Support checks answer
for the CPU emulation: FP8 (delayed / current scaling) is "available" (emulated); MXFP8 only when
``ACCEL_FP8_FIX_EMULATE_MXFP8=1``; block scaling and NVFP4 are not.
"""

from __future__ import annotations

import abc
import os
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch

from accel_fp8_fix.emulation import _stats
from ..common.recipe import (
    CustomRecipe,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    Recipe,
)

__emulated__ = True

dist_group_type = Any
ENV_MXFP8 = "ACCEL_FP8_FIX_EMULATE_MXFP8"


def _default_device() -> torch.device:
    return torch.device("cpu")


# --------------------------------------------------------------------------------------------------
# Support checks (the emulation's answers)


def check_fp8_support() -> Tuple[bool, str]:
    """FP8 per-tensor scaling (delayed, current) is emulated on CPU: always available."""
    return True, ""


def check_mxfp8_support() -> Tuple[bool, str]:
    """MXFP8 is emulated only on request (``ACCEL_FP8_FIX_EMULATE_MXFP8=1``)."""
    if os.environ.get(ENV_MXFP8, "0").strip().lower() in ("1", "true", "yes", "on"):
        return True, ""
    return False, f"MXFP8 not available: emulation on CPU (set {ENV_MXFP8}=1 to emulate it)"


def check_nvfp4_support() -> Tuple[bool, str]:
    return False, "NVFP4 not available: emulation on CPU does not emulate NVFP4"


def check_fp8_block_scaling_support() -> Tuple[bool, str]:
    return False, "FP8 block scaling not available: emulation on CPU does not emulate it"


def check_recipe_support(recipe: Recipe) -> None:
    """Raise RuntimeError if the emulation cannot run ``recipe``."""
    ok, reason = True, ""
    if isinstance(recipe, (DelayedScaling, Float8CurrentScaling)):
        ok, reason = check_fp8_support()
    elif isinstance(recipe, Float8BlockScaling):
        ok, reason = check_fp8_block_scaling_support()
    elif isinstance(recipe, MXFP8BlockScaling):
        ok, reason = check_mxfp8_support()
    elif isinstance(recipe, NVFP4BlockScaling):
        ok, reason = check_nvfp4_support()
    if not ok:
        raise RuntimeError(reason)


def _as_bool_or_tuple(res: Tuple[bool, str], return_reason: bool):
    return res if return_reason else res[0]


def is_fp8_available(return_reason: bool = False) -> Union[bool, Tuple[bool, str]]:
    return _as_bool_or_tuple(check_fp8_support(), return_reason)


def is_mxfp8_available(return_reason: bool = False) -> Union[bool, Tuple[bool, str]]:
    return _as_bool_or_tuple(check_mxfp8_support(), return_reason)


def is_fp8_block_scaling_available(return_reason: bool = False) -> Union[bool, Tuple[bool, str]]:
    return _as_bool_or_tuple(check_fp8_block_scaling_support(), return_reason)


def is_nvfp4_available(return_reason: bool = False) -> Union[bool, Tuple[bool, str]]:
    return _as_bool_or_tuple(check_nvfp4_support(), return_reason)


def get_default_fp8_recipe() -> Recipe:
    """As TE: MXFP8 if supported, else DelayedScaling (no compute capability >= 12 on CPU)."""
    if check_mxfp8_support()[0]:
        return MXFP8BlockScaling()
    return DelayedScaling()


def get_default_recipe() -> Recipe:
    return get_default_fp8_recipe()


def get_fp8_torch_dtype(fp8_recipe: Recipe, fprop_tensor: bool = True) -> torch.dtype:
    if fp8_recipe.fp8_format == Format.E4M3 or (fp8_recipe.fp8_format == Format.HYBRID and fprop_tensor):
        return torch.float8_e4m3fn
    return torch.float8_e5m2


get_fp8_te_dtype = get_fp8_torch_dtype  # the emulation has no tex.DType; torch dtypes stand in


def get_fp8_max(fp8_recipe: Recipe, fprop_tensor: bool = True) -> float:
    if fp8_recipe.fp8_format == Format.E4M3 or (fp8_recipe.fp8_format == Format.HYBRID and fprop_tensor):
        return Format.E4M3.value.max_fwd
    return Format.E5M2.value.max_fwd


# --------------------------------------------------------------------------------------------------
# Delayed-scaling amax / scale update (TE's unfused reference path, same formulas as the fused kernel)


def _update_amax_history(amax_history: torch.Tensor) -> torch.Tensor:
    """Update amax history and set next amax to zero."""
    if amax_history.shape[0] > 1:
        new_amax_history = torch.roll(amax_history, -1, 0)
        amax_history.copy_(new_amax_history)
    amax_history[0].fill_(0.0)
    return amax_history


def _default_get_amax_and_update_history(amax_history: torch.Tensor, amax_compute_algo: str):
    if amax_compute_algo == "max":
        amax = torch.max(amax_history, dim=0).values
    else:  # "most_recent"
        amax = amax_history[0].clone()
    amax_history = _update_amax_history(amax_history)
    return amax_history, amax


def _default_sf_compute(
    amax: torch.Tensor,
    scale: torch.Tensor,
    fp8_max: float,
    margin: int,
    _fp32_max: float = torch.finfo(torch.float32).max,
) -> torch.Tensor:
    """TE's amax -> scale: (fp8_max / amax) / 2**margin; keep the old scale for amax == 0 or
    non-finite amax; an infinite result becomes FP32_MAX."""
    sf = (fp8_max / amax) / (2**margin)
    sf = torch.where(amax > 0.0, sf, scale)
    sf = torch.where(torch.isfinite(amax), sf, scale)
    sf = torch.where(torch.isinf(sf), torch.full_like(sf, _fp32_max), sf)
    scale.copy_(sf)
    return scale


def _compute_amax_and_update_history(amax_history, amax_compute_algo):
    if callable(amax_compute_algo):
        amax = amax_compute_algo(amax_history)
        amax_history = _update_amax_history(amax_history)
        return amax_history, amax
    return _default_get_amax_and_update_history(amax_history, amax_compute_algo)


def _compute_scaling_factor(amax, scale, fp8_max, recipe: DelayedScaling):
    if recipe.scaling_factor_compute_algo is None:
        return _default_sf_compute(amax, scale, fp8_max, recipe.margin)
    return recipe.scaling_factor_compute_algo(amax, scale, fp8_max, recipe)


def _amax_and_scale_update(amax_history, scale, fp8_max, recipe: DelayedScaling) -> None:
    new_amax_history, amax = _compute_amax_and_update_history(amax_history, recipe.amax_compute_algo)
    new_scale = _compute_scaling_factor(amax, scale, fp8_max, recipe)
    scale.copy_(new_scale)
    amax_history.copy_(new_amax_history)


def split_and_copy(buffer: torch.Tensor, outputs: List[torch.Tensor], chunk_sizes: List[int]) -> None:
    splits = buffer.split(chunk_sizes)
    torch._foreach_copy_(outputs, splits)


# --------------------------------------------------------------------------------------------------
# Global state


@dataclass
class FP8GlobalState:
    fp8_enabled: bool = False
    fp8_calibration: bool = False
    fp8_recipe: Optional[Recipe] = None
    fp8_distributed_group: Optional[dist_group_type] = None
    fp8_parameters: bool = False
    high_precision_init_val: bool = False
    is_first_fp8_module: bool = False
    fp8_graph_capturing: bool = False
    autocast_depth: int = 0
    global_amax_buffer: Dict[str, list] = field(default_factory=dict)
    global_amax_history_buffer: Dict[str, list] = field(default_factory=dict)
    global_scale_buffer: Dict[str, list] = field(default_factory=dict)
    fp8_tensors_recompute_buffer: list = field(default_factory=list)
    autocast_arguments: Dict[Any, Tuple[Recipe, Optional[dist_group_type]]] = field(default_factory=dict)
    skip_fp8_weight_update_tensor: Optional[torch.Tensor] = None


def _group_desc(group):
    """Comparable description of a process group for stats(): "WORLD" or the list of global ranks."""
    import torch.distributed as dist

    if group is None or group is dist.group.WORLD:
        return "WORLD"
    try:
        return sorted(dist.get_process_group_ranks(group))
    except Exception:  # pragma: no cover
        return repr(group)


class FP8GlobalStateManager:
    """Keeps track of the global FP8 state (emulation of TE's class of the same name)."""

    quantization_state = FP8GlobalState()

    @classmethod
    def set_skip_fp8_weight_update_tensor(cls, skip: bool) -> None:
        if cls.quantization_state.skip_fp8_weight_update_tensor is None:
            cls.quantization_state.skip_fp8_weight_update_tensor = torch.empty(1, dtype=torch.float32)
        cls.quantization_state.skip_fp8_weight_update_tensor.fill_(skip)

    @classmethod
    def get_skip_fp8_weight_update_tensor(cls) -> Optional[torch.Tensor]:
        return cls.quantization_state.skip_fp8_weight_update_tensor

    @classmethod
    def reset(cls) -> None:
        cls.quantization_state = FP8GlobalState()

    @classmethod
    def is_fp8_available(cls) -> Tuple[bool, str]:
        return check_fp8_support()

    @classmethod
    def is_mxfp8_available(cls) -> Tuple[bool, str]:
        return check_mxfp8_support()

    @classmethod
    def is_fp8_block_scaling_available(cls) -> Tuple[bool, str]:
        return check_fp8_block_scaling_support()

    @classmethod
    def is_nvfp4_available(cls) -> Tuple[bool, str]:
        return check_nvfp4_support()

    @staticmethod
    def get_meta_tensor_key(forward: bool = True) -> str:
        return "scaling_fwd" if forward else "scaling_bwd"

    @staticmethod
    def get_fwd_bwd_key(forward: bool = True) -> str:
        return "forward" if forward else "backward"

    @classmethod
    def get_buffer_info(cls) -> str:
        return "buffer_index_and_autocast_key"

    @classmethod
    def get_key_in_buffer(cls, forward: bool, fp8_recipe: Recipe, fp8_group) -> str:
        autocast_key = cls.get_unique_autocast_key(fp8_recipe, fp8_group)
        return f"{cls.get_fwd_bwd_key(forward)}_{autocast_key}"

    @classmethod
    def split_key_in_buffer(cls, key: str) -> Tuple[bool, str]:
        forward, autocast_key = key.split("_", 1)
        return forward == "forward", autocast_key

    @classmethod
    def add_fp8_tensors_to_global_buffer(cls, fp8_meta: Dict[str, Any]) -> None:
        """Delayed scaling only: register this module's amax/scale tensors once for the reductions."""
        if not _has_delayed_scaling_state(fp8_meta):
            return
        index_in_buffer = cls.get_buffer_info()
        if index_in_buffer in fp8_meta:
            return
        fp8_meta[index_in_buffer] = []
        qstate = cls.quantization_state
        for forward in (True, False):
            meta_key = cls.get_meta_tensor_key(forward=forward)
            if meta_key not in fp8_meta:
                continue
            state = fp8_meta[meta_key]
            key = cls.get_key_in_buffer(forward, fp8_meta["recipe"], fp8_meta["fp8_group"])
            if key not in qstate.global_amax_buffer:
                qstate.global_amax_buffer[key] = [state.amax_history[0]]
                qstate.global_amax_history_buffer[key] = [state.amax_history]
                qstate.global_scale_buffer[key] = [state.scale]
            else:
                qstate.global_amax_buffer[key].append(state.amax_history[0])
                qstate.global_amax_history_buffer[key].append(state.amax_history)
                qstate.global_scale_buffer[key].append(state.scale)
            fp8_meta[index_in_buffer].append(len(qstate.global_amax_buffer[key]) - 1)
            fp8_meta[index_in_buffer].append(key)

    @classmethod
    def is_fp8_enabled(cls) -> bool:
        return cls.quantization_state.fp8_enabled

    @classmethod
    def is_fp8_calibration(cls) -> bool:
        return cls.quantization_state.fp8_calibration

    @classmethod
    def with_fp8_parameters(cls) -> bool:
        return cls.quantization_state.fp8_parameters

    @classmethod
    def with_high_precision_init_val(cls) -> bool:
        return cls.quantization_state.high_precision_init_val

    @classmethod
    def fp8_graph_capturing(cls) -> bool:
        return cls.quantization_state.fp8_graph_capturing

    @classmethod
    def is_first_fp8_module(cls):
        tmp = cls.quantization_state.is_first_fp8_module
        cls.quantization_state.is_first_fp8_module = False
        return tmp

    @classmethod
    def get_fp8_recipe(cls) -> Recipe:
        if cls.quantization_state.fp8_recipe is not None:
            return cls.quantization_state.fp8_recipe
        return get_default_fp8_recipe()

    @classmethod
    def get_fp8_group(cls):
        return cls.quantization_state.fp8_distributed_group

    @classmethod
    def get_autocast_state(cls) -> tuple:
        q = cls.quantization_state
        return (
            q.fp8_enabled,
            q.fp8_calibration,
            q.fp8_recipe,
            q.fp8_distributed_group,
            q.is_first_fp8_module,
            q.fp8_graph_capturing,
        )

    @classmethod
    def set_autocast_state(cls, state: tuple) -> None:
        q = cls.quantization_state
        (
            q.fp8_enabled,
            q.fp8_calibration,
            q.fp8_recipe,
            q.fp8_distributed_group,
            q.is_first_fp8_module,
            q.fp8_graph_capturing,
        ) = state

    @staticmethod
    def reduce_tensor_across_group_op_max(tensor: torch.Tensor, group) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group, async_op=False)

    @classmethod
    def reduce_and_update_fp8_tensors(cls, forward: bool = True) -> None:
        """Delayed scaling only: concatenate, reduce (one all_reduce(MAX) per recipe/group key), split,
        then update amax histories and scales."""
        import torch.distributed as dist

        qstate = cls.quantization_state
        for buffer_key, amax_buffer in qstate.global_amax_buffer.items():
            fwd_update, autocast_key = cls.split_key_in_buffer(buffer_key)
            if fwd_update != forward or len(amax_buffer) == 0:
                continue
            recipe, group = qstate.autocast_arguments[autocast_key]
            contiguous_amax = torch.cat(amax_buffer)
            if (
                recipe.reduce_amax
                and dist.is_available()
                and dist.is_initialized()
                and dist.get_world_size(group=group) > 1
            ):
                cls.reduce_tensor_across_group_op_max(contiguous_amax, group)
                _stats.record_reduction(_group_desc(group), contiguous_amax.numel(), forward)
            split_and_copy(contiguous_amax, amax_buffer, [x.numel() for x in amax_buffer])
            for amax_history, scale in zip(
                qstate.global_amax_history_buffer[buffer_key], qstate.global_scale_buffer[buffer_key]
            ):
                _amax_and_scale_update(amax_history, scale, get_fp8_max(recipe, forward), recipe)
            _stats.bump("scale_updates")

    @staticmethod
    def get_unique_autocast_key(recipe: Optional[Recipe] = None, group=None):
        group_id = id(group) if group is not None else None
        return f"recipe={str(recipe)},group={group_id}"

    @classmethod
    def autocast_enter(cls, enabled=False, calibrating=False, fp8_recipe=None, fp8_group=None, _graph=False):
        fp8_recipe = get_default_fp8_recipe() if fp8_recipe is None else fp8_recipe
        autocast_key = cls.get_unique_autocast_key(fp8_recipe, fp8_group)
        qstate = cls.quantization_state
        qstate.autocast_arguments[autocast_key] = (fp8_recipe, fp8_group)
        qstate.fp8_enabled = enabled
        qstate.fp8_calibration = calibrating
        qstate.fp8_recipe = fp8_recipe
        qstate.fp8_distributed_group = fp8_group
        qstate.fp8_graph_capturing = _graph
        if qstate.autocast_depth == 0:
            qstate.is_first_fp8_module = True
        qstate.autocast_depth += 1
        if enabled:
            ok, reason = cls.is_fp8_available()
            assert ok, reason
            if isinstance(fp8_recipe, MXFP8BlockScaling):
                ok, reason = cls.is_mxfp8_available()
                assert ok, reason
            if isinstance(fp8_recipe, Float8BlockScaling):
                ok, reason = cls.is_fp8_block_scaling_available()
                assert ok, reason
            if isinstance(fp8_recipe, NVFP4BlockScaling):
                ok, reason = cls.is_nvfp4_available()
                assert ok, reason

    @classmethod
    def autocast_exit(cls, enabled: bool, _graph: bool) -> None:
        qstate = cls.quantization_state
        qstate.autocast_depth -= 1
        if enabled and qstate.autocast_depth == 0 and not _graph and torch.is_grad_enabled():
            cls.reduce_and_update_fp8_tensors(forward=True)


def _has_delayed_scaling_state(fp8_meta: Dict[str, Any]) -> bool:
    return isinstance(fp8_meta.get("scaling_fwd"), DelayedScalingRecipeState)


@contextmanager
def quantized_model_init(enabled: bool = True, recipe: Optional[Recipe] = None, preserve_high_precision_init_val: bool = False):
    """Records the flags like TE; the emulation keeps high-precision parameters (no FP8 params), but
    modules built inside create their FP8 recipe state eagerly (``primary_weights_in_fp8`` is set)."""
    qstate = FP8GlobalStateManager.quantization_state
    saved = (qstate.fp8_parameters, qstate.fp8_recipe, qstate.high_precision_init_val)
    qstate.fp8_parameters = enabled
    qstate.fp8_recipe = get_default_fp8_recipe() if recipe is None else recipe
    qstate.high_precision_init_val = preserve_high_precision_init_val
    try:
        yield
    finally:
        qstate.fp8_parameters, qstate.fp8_recipe, qstate.high_precision_init_val = saved


@contextmanager
def fp8_model_init(enabled: bool = True, recipe: Optional[Recipe] = None, preserve_high_precision_init_val: bool = False):
    warnings.warn(
        "fp8_model_init is deprecated and will be removed in a future release. "
        "Use quantized_model_init(enabled=..., recipe=..., preserve_high_precision_init_val=...) instead.",
        category=DeprecationWarning,
        stacklevel=3,
    )
    with quantized_model_init(enabled=enabled, recipe=recipe, preserve_high_precision_init_val=preserve_high_precision_init_val):
        yield


class autocast:
    """Context manager for FP8 quantization (emulated). Same arguments as TE 2.9+."""

    __slots__ = ("_enabled", "_calibrating", "_recipe", "_amax_reduction_group", "_graph", "_fp8_state")

    def __init__(
        self,
        enabled: bool = True,
        calibrating: bool = False,
        recipe: Optional[Recipe] = None,
        amax_reduction_group: Optional[dist_group_type] = None,
        _graph: bool = False,
    ) -> None:
        self._enabled = enabled
        self._calibrating = calibrating
        self._recipe = recipe
        self._amax_reduction_group = amax_reduction_group
        self._graph = _graph
        self._fp8_state = None

    def __enter__(self) -> "autocast":
        if self._fp8_state is not None:
            raise RuntimeError("autocast context manager cannot be entered more than once concurrently")
        if self._enabled:
            check_recipe_support(self._recipe)
        self._fp8_state = FP8GlobalStateManager.get_autocast_state()
        FP8GlobalStateManager.autocast_enter(
            enabled=self._enabled,
            calibrating=self._calibrating,
            fp8_recipe=self._recipe,
            fp8_group=self._amax_reduction_group,
            _graph=self._graph,
        )
        return self

    def __exit__(self, exc_type, exc_val, exc_tb) -> None:
        try:
            FP8GlobalStateManager.set_autocast_state(self._fp8_state)
            FP8GlobalStateManager.autocast_exit(self._enabled, _graph=self._graph)
        finally:
            self._fp8_state = None


def fp8_autocast(
    enabled: bool = True,
    calibrating: bool = False,
    fp8_recipe: Optional[Recipe] = None,
    fp8_group: Optional[dist_group_type] = None,
    _graph: bool = False,
) -> autocast:
    """Deprecated alias of :class:`autocast` (as in TE >= 2.9)."""
    warnings.warn(
        "fp8_autocast is deprecated and will be removed in a future release. "
        "Use autocast(enabled=..., calibrating=..., recipe=..., group=..., _graph=...) instead.",
        category=DeprecationWarning,
        stacklevel=2,
    )
    return autocast(enabled=enabled, calibrating=calibrating, recipe=fp8_recipe, amax_reduction_group=fp8_group, _graph=_graph)


# --------------------------------------------------------------------------------------------------
# Recipe states (TE 2.x layout)


class RecipeState(abc.ABC):
    """Configuration and state for a quantization recipe."""

    _persistent_state_buffers: Tuple[str, ...] = ()

    @staticmethod
    def create(recipe: Recipe, *, mode: str, num_quantizers: int = 1, device=None, roles=None) -> "RecipeState":
        if recipe.delayed():
            cls = DelayedScalingRecipeState
        elif recipe.mxfp8():
            cls = MXFP8BlockScalingRecipeState
        elif recipe.float8_current_scaling():
            cls = Float8CurrentScalingRecipeState
        else:
            raise ValueError(f"{recipe.__class__.__name__} is not supported by the emulation")
        return cls(recipe, mode=mode, num_quantizers=num_quantizers, device=device, roles=roles)

    def _init_common(self, recipe, mode, num_quantizers, roles):
        self.recipe = recipe
        self.mode = mode
        self.num_quantizers = num_quantizers
        self.roles = roles
        self.dtype = get_fp8_torch_dtype(recipe, mode == "forward")

    @abc.abstractmethod
    def make_quantizers(self) -> list:
        """Convert recipe state to quantizers."""

    def inherit_state_from(self, other: "RecipeState") -> bool:
        if type(self) is not type(other) or not self._persistent_state_buffers:
            return False
        for name in self._persistent_state_buffers:
            src, dst = getattr(other, name), getattr(self, name)
            if src.shape != dst.shape or src.dtype != dst.dtype:
                return False
        for name in self._persistent_state_buffers:
            setattr(self, name, getattr(other, name))
        return True


class DelayedScalingRecipeState(RecipeState):
    """Per-tensor delayed scaling: ``scale`` [num_quantizers] and ``amax_history``
    [amax_history_len, num_quantizers], fp32."""

    _persistent_state_buffers = ("scale", "amax_history")

    def __init__(self, recipe: DelayedScaling, *, mode: str, num_quantizers: int = 1, device=None, roles=None) -> None:
        self._init_common(recipe, mode, num_quantizers, roles)
        device = _default_device() if device is None else device
        self.scale = torch.ones(num_quantizers, dtype=torch.float32, device=device)
        self.amax_history = torch.zeros(recipe.amax_history_len, num_quantizers, dtype=torch.float32, device=device)

    def make_quantizers(self) -> list:
        from ._numerics import Float8Quantizer

        return [Float8Quantizer(self, i, self.dtype) for i in range(self.num_quantizers)]


class Float8CurrentScalingRecipeState(RecipeState):
    """Per-tensor current scaling: no state."""

    def __init__(self, recipe: Float8CurrentScaling, *, mode: str, num_quantizers: int = 1, device=None, roles=None) -> None:
        self._init_common(recipe, mode, num_quantizers, roles)
        self.device = _default_device() if device is None else device

    def make_quantizers(self) -> list:
        from ._numerics import Float8CurrentScalingQuantizer

        return [
            Float8CurrentScalingQuantizer(self.dtype, force_pow_2_scales=self.recipe.use_power_2_scales)
            for _ in range(self.num_quantizers)
        ]


class MXFP8BlockScalingRecipeState(RecipeState):
    """MXFP8: no state (per-block E8M0 scales are computed from each tensor)."""

    def __init__(self, recipe: MXFP8BlockScaling, *, mode: str, num_quantizers: int = 1, device=None, roles=None) -> None:
        self._init_common(recipe, mode, num_quantizers, roles)

    def make_quantizers(self) -> list:
        from ._numerics import MXFP8Quantizer

        return [MXFP8Quantizer(self.dtype) for _ in range(self.num_quantizers)]
