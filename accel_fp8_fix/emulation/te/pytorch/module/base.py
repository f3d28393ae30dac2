"""Emulated ``TransformerEngineBaseModule`` (checked against TE 2.20.2 pytorch/module/base.py).

Same attributes, ``fp8_meta`` dict layout (a plain attribute, never a buffer), ``init_fp8_metadata``,
``set_meta_tensor``, ``get_extra_state`` / ``set_extra_state`` (uint8 tensor of a pickle; empty when FP8
was never used or the recipe is stateless). Differences: no CUDA requirement, state on the module's
device (CPU), no userbuffers / debug / CUDA graphs.
"""

from __future__ import annotations

import io
import pickle
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Union

import torch

from ..quantization import (
    DelayedScalingRecipeState,
    Float8CurrentScalingRecipeState,
    FP8GlobalStateManager,
    MXFP8BlockScalingRecipeState,
    RecipeState,
    _has_delayed_scaling_state,
)
from ...common.recipe import DelayedScaling, Recipe
from ...debug.pytorch.debug_state import TEDebugState

__emulated__ = True


def init_method_normal(sigma: float) -> Callable:
    def init_(tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(tensor, mean=0.0, std=sigma)

    return init_


def init_method_constant(val: float) -> Callable:
    def init_(tensor: torch.Tensor) -> torch.Tensor:
        if val == 0.0:
            return torch.nn.init.zeros_(tensor)
        return torch.nn.init.constant_(tensor, val)

    return init_


def get_default_init_method() -> Callable:
    """Weight initialization method if not provided by user (TE: normal, std 0.023)."""
    return init_method_normal(0.023)


@dataclass
class _ParameterInitMeta:
    init_fn: Optional[Callable] = None
    get_rng_state_tracker: Optional[Callable] = None
    fp8_meta_index: Optional[int] = None

    def __post_init__(self):
        if self.init_fn is None:
            self.init_fn = get_default_init_method()


def _is_dtensor(t) -> bool:
    if t is None or not isinstance(t, torch.Tensor):
        return False
    try:
        from torch.distributed.tensor import DTensor
    except Exception:  # pragma: no cover
        return False
    return isinstance(t, DTensor)


def _is_stateless_recipe(recipe: Recipe) -> bool:
    return not recipe.delayed()


def _materialize_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


class TransformerEngineBaseModule(torch.nn.Module, ABC):
    """Base class of the emulated TE modules (CPU emulation; not real Transformer Engine)."""

    __emulated__ = True

    def __init__(self, name: Optional[str] = None) -> None:
        super().__init__()
        self.name = name
        self.next_iter_when_debug_should_be_run = 0
        self.fp8_initialized = False
        self.fp8 = False
        self.fp8_calibration = False
        self.fp8_meta = {}
        self.fp8_meta["fp8_checkpoint"] = False
        self.fp8_meta["fp8_group"] = None
        self.fp8_meta_tensors_initialized = False
        self.quantizers = {"scaling_fwd": [], "scaling_bwd": []}
        self.tp_group = None
        self.tp_size = 1
        self.sequence_parallel = False
        self.param_init_meta = {}
        self.primary_weights_in_fp8 = FP8GlobalStateManager.with_fp8_parameters()
        self.preserve_high_precision_init_val = FP8GlobalStateManager.with_high_precision_init_val()
        self.fsdp_wrapped = False
        self.fsdp_group = None
        self._fp8_workspaces: Dict[str, Any] = {}
        self.activation_dtype: Optional[torch.dtype] = None
        self.wgrad_accumulation_and_reduce_hooks = []
        self.wgrad_store = None
        self._output_quantizer_role = None
        self._grad_input_quantizer_role = None
        # Emulation-only counters (also summed process-wide in accel_fp8_fix.emulation.stats()).
        self.fp8_gemm_count = 0
        self.non_fp8_gemm_count = 0

        if not TEDebugState.debug_enabled:
            TEDebugState.initialize()
        self._validate_name()

    # ---------------------------------------------------------------- attribute helpers
    def fast_setattr(self, name: str, value: Any) -> None:
        self.__dict__[name] = value

    def module_setattr(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)

    def _emulation_label(self) -> str:
        return f"{type(self).__name__}"

    def _state_device(self) -> torch.device:
        for p in self.parameters(recurse=False):
            if p is None:
                continue
            dev = p.device
            if _is_dtensor(p):
                dev = p.to_local().device
            if dev.type != "meta":
                return dev
        return torch.device("cpu")

    # ---------------------------------------------------------------- FP8 metadata
    def adjust_amax_history_length(self, length: int, fwd: Optional[bool] = None) -> None:
        """Resize the delayed-scaling amax history (keeps the newest entries, like TE)."""
        keys = ["scaling_fwd", "scaling_bwd"] if fwd is None else ["scaling_fwd" if fwd else "scaling_bwd"]
        for key in keys:
            state = self.fp8_meta.get(key)
            if not isinstance(state, DelayedScalingRecipeState):
                continue
            cur = state.amax_history.shape[0]
            if cur == length:
                continue
            if cur < length:
                new = torch.nn.functional.pad(state.amax_history, (0, 0, 0, length - cur))
            else:
                new = state.amax_history[:length].clone()
            state.amax_history.data = new  # keep the object; refresh global-buffer views
            qstate = FP8GlobalStateManager.quantization_state
            info = self.fp8_meta.get(FP8GlobalStateManager.get_buffer_info())
            if info:
                for pos, buffer_key in zip(info[0::2], info[1::2]):
                    if buffer_key in qstate.global_amax_history_buffer:
                        fwd_update, _ = FP8GlobalStateManager.split_key_in_buffer(buffer_key)
                        if fwd_update == (key == "scaling_fwd"):
                            qstate.global_amax_history_buffer[buffer_key][pos] = state.amax_history
                            qstate.global_amax_buffer[buffer_key][pos] = state.amax_history[0]

    def set_meta_tensor(self, fwd: bool, recipe: Recipe) -> None:
        """Init scales and amaxes for fwd | bwd."""
        key = "scaling_fwd" if fwd else "scaling_bwd"
        if self.fp8_meta_tensors_initialized:
            recipe_state = self.fp8_meta[key]
            if recipe.delayed() and isinstance(recipe_state, DelayedScalingRecipeState):
                self.adjust_amax_history_length(recipe.amax_history_len, fwd=fwd)
                return
            if recipe.mxfp8() and isinstance(recipe_state, MXFP8BlockScalingRecipeState):
                return
            if recipe.float8_current_scaling() and isinstance(recipe_state, Float8CurrentScalingRecipeState):
                return
        # Max. number of fp8 tensors per GEMM = 3 (input, weight, output) fwd, 2 (grad_output, grad_input) bwd
        num_fp8_tensors = self.fp8_meta["num_gemms"] * 3 if fwd else self.fp8_meta["num_gemms"] * 2
        recipe_state = RecipeState.create(
            recipe,
            mode=("forward" if fwd else "backward"),
            num_quantizers=num_fp8_tensors,
            device=self._state_device(),
        )
        old_state = self.fp8_meta.get(key)
        if old_state is not None:
            recipe_state.inherit_state_from(old_state)
        self.fp8_meta[key] = recipe_state
        self.quantizers[key] = recipe_state.make_quantizers()

    def init_fp8_meta_tensors(self, recipe: Recipe) -> None:
        self.set_meta_tensor(True, recipe)
        self.set_meta_tensor(False, recipe)
        self.fast_setattr("fp8_meta_tensors_initialized", True)

    def get_fp8_meta_tensors(self):
        fwd_key, bwd_key = "scaling_fwd", "scaling_bwd"
        if fwd_key not in self.fp8_meta or bwd_key not in self.fp8_meta:
            return None
        out = {fwd_key: [], bwd_key: []}
        with torch.no_grad():
            for key in (fwd_key, bwd_key):
                out[key].append(self.fp8_meta[key].scale.clone())
                out[key].append(self.fp8_meta[key].amax_history.clone())
        return out

    def reset_fp8_meta_tensors(self, fp8_meta_tensors=None) -> None:
        def reset(key):
            if key in self.fp8_meta:
                if fp8_meta_tensors is None:
                    self.fp8_meta[key].scale.copy_(torch.ones_like(self.fp8_meta[key].scale))
                    self.fp8_meta[key].amax_history.copy_(torch.zeros_like(self.fp8_meta[key].amax_history))
                else:
                    self.fp8_meta[key].scale.copy_(fp8_meta_tensors[key][0])
                    self.fp8_meta[key].amax_history.copy_(fp8_meta_tensors[key][1])

        with torch.no_grad():
            reset("scaling_fwd")
            reset("scaling_bwd")

    def init_fp8_metadata(self, num_gemms: int = 1) -> None:
        """Initialize FP8 metadata from the *current* autocast state (as TE). To create the state
        eagerly (e.g. at prepare time), call it inside ``autocast(enabled=True, recipe=...,
        amax_reduction_group=...)``, or use :meth:`emulation_init_fp8_state`."""
        meta = self.fp8_meta
        fp8 = FP8GlobalStateManager.is_fp8_enabled()
        fp8_parameters = FP8GlobalStateManager.with_fp8_parameters()
        fp8_calibration = FP8GlobalStateManager.is_fp8_calibration()
        self.fast_setattr("fp8_parameters", fp8_parameters)
        self.fast_setattr("fp8", fp8)
        self.fast_setattr("fp8_calibration", fp8_calibration)
        fp8_enabled = fp8 or fp8_calibration
        meta["fp8_checkpoint"] = fp8_enabled

        _original_recipe = None
        if fp8_parameters or fp8_enabled:
            _original_recipe = meta.get("recipe", None)
            if self.fp8_initialized and FP8GlobalStateManager.get_fp8_recipe() == _original_recipe:
                return
            meta["recipe"] = FP8GlobalStateManager.get_fp8_recipe()
        else:
            self.fast_setattr("fp8_initialized", False)
            return

        if fp8_parameters and not self.fp8_initialized:
            meta["num_gemms"] = num_gemms
            self.init_fp8_meta_tensors(meta["recipe"])

        if fp8_enabled:
            meta["num_gemms"] = num_gemms
            meta["fp8_group"] = FP8GlobalStateManager.get_fp8_group()
            if hasattr(meta["recipe"], "fp8_format"):
                meta["fp8_max_fwd"] = meta["recipe"].fp8_format.value.max_fwd
                meta["fp8_max_bwd"] = meta["recipe"].fp8_format.value.max_bwd
            self.init_fp8_meta_tensors(meta["recipe"])
            self.fast_setattr("fp8_initialized", True)
            meta["recipe"] = FP8GlobalStateManager.get_fp8_recipe()

        _current_recipe = meta["recipe"]
        if _original_recipe is not None and not (
            issubclass(_current_recipe.__class__, _original_recipe.__class__)
            or issubclass(_original_recipe.__class__, _current_recipe.__class__)
        ):
            warnings.warn(
                f"Recipe type changed from {_original_recipe.__class__.__name__} "
                f"to {_current_recipe.__class__.__name__}. This may affect model behavior."
            )
            self._fp8_workspaces.clear()

    def emulation_init_fp8_state(self, recipe: Optional[Recipe] = None, fp8_group=None) -> None:
        """Emulation helper (not in TE): create the FP8 state now, as the first FP8 forward under
        ``autocast(enabled=True, recipe=recipe, amax_reduction_group=fp8_group)`` would. Issues no
        collective (the autocast is exited under ``torch.no_grad``)."""
        from ..quantization import autocast

        with torch.no_grad(), autocast(enabled=True, recipe=recipe, amax_reduction_group=fp8_group):
            self.init_fp8_metadata(num_gemms=getattr(self, "_num_gemms", 1))

    # ---------------------------------------------------------------- checkpointing
    def get_extra_state(self) -> torch.Tensor:
        """TE 2.x format: uint8 tensor of a pickle of the FP8 state; empty if FP8 never ran or the
        recipe is stateless."""
        fp8_checkpoint = self.fp8_meta["fp8_checkpoint"] or self.fp8 or self.fp8_calibration
        if not fp8_checkpoint:
            return torch.empty(0, dtype=torch.uint8)
        recipe = self.fp8_meta["recipe"]
        if _is_stateless_recipe(recipe):
            return torch.empty(0, dtype=torch.uint8)

        def to_cpu(src: torch.Tensor) -> torch.Tensor:
            dst = torch.empty_like(src, device="cpu")
            dst.copy_(src)
            return dst

        state = {"recipe": recipe}
        if _has_delayed_scaling_state(self.fp8_meta):
            state["scale_fwd"] = to_cpu(self.fp8_meta["scaling_fwd"].scale)
            state["amax_history_fwd"] = to_cpu(self.fp8_meta["scaling_fwd"].amax_history)
            state["scale_bwd"] = to_cpu(self.fp8_meta["scaling_bwd"].scale)
            state["amax_history_bwd"] = to_cpu(self.fp8_meta["scaling_bwd"].amax_history)
        extra = {}
        for k, v in self.fp8_meta.items():
            if k != "buffer_index_and_autocast_key" and isinstance(v, (bool, int, float, str, tuple, list)):
                extra[k] = v
        state["extra_fp8_variables"] = extra
        state_serialized = bytearray(pickle.dumps(state))
        return torch.frombuffer(state_serialized, dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        if state is None:
            return
        if isinstance(state, torch.Tensor):
            if state.numel() == 0:
                return
            state = pickle.loads(state.detach().cpu().numpy().tobytes())
        elif isinstance(state, io.BytesIO):  # TE 1.x format
            state.seek(0)
            state = torch.load(state, map_location="cpu", weights_only=False)
        else:
            raise RuntimeError("Unsupported checkpoint format.")
        if state is None:
            return
        if "recipe" not in state:  # TE 1.x checkpoint: delayed scaling only
            state["recipe"] = DelayedScaling()
            state.pop("scale_inv_fwd", None)
            state.pop("scale_inv_bwd", None)
        self.fp8_meta.update(state["extra_fp8_variables"])
        self.fp8_meta["recipe"] = state["recipe"]
        self.fp8_meta.pop("global_fp8_buffer_pos_fwd_recompute", None)
        self.init_fp8_meta_tensors(self.fp8_meta["recipe"])
        if _has_delayed_scaling_state(self.fp8_meta):
            with torch.no_grad():
                self.fp8_meta["scaling_fwd"].scale.copy_(state["scale_fwd"])
                self.fp8_meta["scaling_fwd"].amax_history.copy_(state["amax_history_fwd"])
                self.fp8_meta["scaling_bwd"].scale.copy_(state["scale_bwd"])
                self.fp8_meta["scaling_bwd"].amax_history.copy_(state["amax_history_bwd"])

    # ---------------------------------------------------------------- forward helpers
    def set_activation_dtype(self, inp: torch.Tensor) -> None:
        for dev in ("cpu", "cuda"):
            try:
                enabled = torch.is_autocast_enabled(dev)
            except Exception:  # pragma: no cover
                enabled = False
            if enabled and (dev == "cpu" and inp.device.type == "cpu" or dev == "cuda" and inp.device.type == "cuda"):
                self.fast_setattr("activation_dtype", torch.get_autocast_dtype(dev))
                return
        dtype = inp.dtype
        if self.activation_dtype == dtype:
            return
        if not getattr(self, "allow_different_data_and_param_types", False):
            for name, param in self.named_parameters():
                if param is not None and dtype != param.dtype:
                    raise TypeError(
                        "Data types for parameters must match when outside of autocasted "
                        f"region. Found input dtype: {dtype} and {name!r} dtype: {param.dtype}"
                    )
        self.fast_setattr("activation_dtype", dtype)

    def set_tensor_parallel_group(self, tp_group) -> None:
        self.fast_setattr("tp_group", tp_group)
        self.fast_setattr("tp_group_initialized", True)

    def _emulation_reject_dtensors(self, inp: torch.Tensor) -> None:
        if _is_dtensor(inp):
            raise TypeError(
                f"emulated transformer_engine {self._emulation_label()}: the input is a DTensor; TE "
                "kernels take local tensors (TE-native TP uses tp_group/parallel_mode with plain local "
                "shards). Pass inp.to_local() / run the module on local shards."
            )
        for name, p in self.named_parameters(recurse=False):
            if _is_dtensor(p):
                raise TypeError(
                    f"emulated transformer_engine {self._emulation_label()}: {name} is a DTensor; TE "
                    "kernels take local tensors (TE-native TP uses tp_group/parallel_mode with plain "
                    "local shards). Use local shards, or unwrap the parameter before forward."
                )

    def prepare_forward(
        self,
        inp: torch.Tensor,
        num_gemms: int = 1,
        allow_non_contiguous: bool = False,
        allow_different_data_and_param_types: bool = False,
    ) -> torch.Tensor:
        self.fast_setattr("allow_different_data_and_param_types", allow_different_data_and_param_types)
        self.fast_setattr("forwarded_at_least_once", True)
        self._emulation_reject_dtensors(inp)
        if self.tp_size > 1 and not getattr(self, "tp_group_initialized", False):
            raise RuntimeError(
                "Tensor parallel group not initialized. Call set_tensor_parallel_group() before forward "
                "pass when tp_size > 1."
            )
        self.set_activation_dtype(inp)
        self.init_fp8_metadata(num_gemms=num_gemms)
        if self.fp8 and _has_delayed_scaling_state(self.fp8_meta):
            if self.sequence_parallel:
                assert self.fp8_meta["recipe"].reduce_amax, (
                    "Amax reduction across tensor parallel group is necessary when using sequence "
                    "parallelism with FP8."
                )
            if not FP8GlobalStateManager.fp8_graph_capturing():
                FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(self.fp8_meta)
        if not allow_non_contiguous and not inp.is_contiguous():
            inp = inp.contiguous()
        return inp

    def end_forward(self) -> None:
        pass

    # ---------------------------------------------------------------- parameters
    def register_parameter(self, name, param, **kwargs):
        super().register_parameter(name, param)
        if hasattr(self, "param_init_meta") and name not in self.param_init_meta:
            self.param_init_meta[name] = _ParameterInitMeta(**kwargs)

    def reset_parameters(self, defer_init: Optional[bool] = False) -> None:
        """Reset parameters to initial values; a parameter on ``meta`` is materialized (on CPU in the
        emulation). DTensor parameters are initialized through their local tensor, as TE does."""
        if defer_init:
            return
        for name, param in self.named_parameters(recurse=False):
            is_dt = _is_dtensor(param)
            dparam = param if is_dt else None
            local = param._local_tensor if is_dt else param
            if local.device == torch.device("meta"):
                local = torch.empty_like(local, device=_materialize_device())
            meta = self.param_init_meta.get(name) or _ParameterInitMeta()
            with torch.no_grad():
                if meta.get_rng_state_tracker is None:
                    meta.init_fn(local)
                else:
                    tracker_name = getattr(self, "rng_tracker_name", None)
                    ctx = meta.get_rng_state_tracker().fork(tracker_name) if tracker_name else meta.get_rng_state_tracker().fork()
                    with ctx:
                        meta.init_fn(local)
            if is_dt:
                from torch.distributed.tensor import DTensor

                new = DTensor.from_local(
                    local.detach(),
                    device_mesh=dparam.device_mesh,
                    placements=dparam.placements,
                    shape=dparam.size(),
                    stride=dparam.stride(),
                )
                self.module_setattr(name, torch.nn.Parameter(new, requires_grad=param.requires_grad))
            else:
                self.module_setattr(name, torch.nn.Parameter(local.detach(), requires_grad=param.requires_grad))

    def _validate_name(self):
        """
        Validate name passed to the module.
        It creates a default name with layer count as the variable
        which may be changed by the user of the module.
        """
        if self.name is not None:
            return

        self.name = f"Layer_{TEDebugState.get_layer_count()}"

    @abstractmethod
    def forward(self):
        """Needs override."""
