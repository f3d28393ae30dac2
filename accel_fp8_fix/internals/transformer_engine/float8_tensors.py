"""Transformer Engine internals and version forks: every TE name this package reaches that TE does not export
(private modules, module-level functions, module globals it swaps), and every fork between TE releases,
decided once per installed TE (as Megatron-core's ``fp8_utils.py`` keeps its TE version decisions in one
module).

- autocast: ``te.autocast(recipe=, amax_reduction_group=)`` (TE 2.9+) or ``te.fp8_autocast(fp8_recipe=,
  fp8_group=)`` (older) — :func:`autocast_factory`;
- ``FP8GlobalStateManager`` and the ``check_*_support`` functions: in ``transformer_engine.pytorch.quantization``
  (TE 2.9+) or ``.fp8`` (older) — :func:`fp8_global_state`, :func:`support_check`;
- ``transformer_engine.pytorch.utils.get_device_compute_capability`` — :func:`device_compute_capability`;
- ``transformer_engine.pytorch.distributed.checkpoint`` (the FP8-aware activation checkpoint) —
  :func:`fp8_checkpoint`;
- the extra-state pickle guard (TE 2.18+, ``transformer_engine.pytorch._extra_state``:
  ``extra_state_pickle_advisory``, ``_classify_extra_state_pickle``, ``_PickledExtraStateAction``) and the
  temporary swap of ``module/base.py``'s ``should_load_extra_state_pickle`` / ``pickle`` globals that lets TE's
  own ``set_extra_state`` apply an already decoded payload — :func:`pickle_advisory`, :func:`ignores_extra_state`,
  :func:`has_pickle_guard`, :func:`loading_decoded`;
- ``GEMMS_PER_MODULE``: TE's ``num_gemms`` per forward of a module class (``init_fp8_metadata``);
  :func:`gemms_per_forward` (a ``GroupedLinear``'s own ``num_gemms``);
- ``GroupedLinear``'s per-GEMM weights ``weight0`` .. ``weight{n-1}`` (read with ``getattr`` by
  ``_get_weight_tensors``): :func:`grouped_linear_without_weights` builds one that owns none,
  :func:`grouped_linear_on_views` runs it on tensors it does not own (MoE experts, fixes/convert/moe_experts.py).

Nothing here imports TE at import time; each fork is resolved on first use and kept. :func:`check` reads TE's
source (importing TE loads its CUDA libraries) when the patch set is applied: a name that is gone refuses
the set, naming it and the installed TE version. TE not installed: nothing to check (TE is optional).
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Mapping

GEMMS_PER_MODULE = {"LayerNormMLP": 2}  # TE's num_gemms per forward; 1 for Linear / LayerNormLinear

# (file under transformer_engine/, text that must be in it): read, not imported.
_SOURCES = (
    ("pytorch/utils.py", "def get_device_compute_capability("),
    ("pytorch/distributed.py", "def checkpoint("),
)
# Version forks: (what, alternatives); one alternative (file, text) must be present.
_FORKS = (
    ("TE autocast (quantization.autocast with amax_reduction_group, or fp8.fp8_autocast)",
     (("pytorch/quantization.py", "amax_reduction_group"), ("pytorch/fp8.py", "def fp8_autocast("))),
    ("FP8GlobalStateManager (in quantization.py or fp8.py)",
     (("pytorch/quantization.py", "class FP8GlobalStateManager"), ("pytorch/fp8.py", "class FP8GlobalStateManager"))),
)
# TE 2.18+ (the release that guards extra-state pickles): checked when TE has _extra_state.py.
_GUARD_FILE = "pytorch/_extra_state.py"
_GUARD_SOURCES = (
    (_GUARD_FILE, "def extra_state_pickle_advisory("),
    (_GUARD_FILE, "def _classify_extra_state_pickle("),
    (_GUARD_FILE, "class _PickledExtraStateAction("),
    (_GUARD_FILE, "IGNORE"),
    ("pytorch/module/base.py", "should_load_extra_state_pickle"),
    ("pytorch/module/base.py", "import pickle"),
)


# -- TE's FP8 state layout on a module (fixes/ reach it only through these; tests/unit/test_layout.py) ----------

FP8_STATE_ATTRS = ("fp8_meta",)  # the attributes of a TE module that hold its FP8 state tensors


def has_fp8_state(module) -> bool:
    """A TE module with FP8 state (``fp8_meta``) that ``init_fp8_metadata`` creates."""
    return hasattr(module, "fp8_meta") and hasattr(module, "init_fp8_metadata")


def init_fp8_metadata(module, num_gemms: int) -> None:
    """Create ``module``'s FP8 state now (as its first FP8 forward would), under the caller's TE autocast."""
    module.init_fp8_metadata(num_gemms=num_gemms)


def keep_fp8_checkpoint(module) -> None:
    """Set TE's ``fp8_meta["fp8_checkpoint"]`` (reset by every forward): ``get_extra_state`` then saves the FP8
    state even when the last forward ran without FP8."""
    module.fp8_meta["fp8_checkpoint"] = True


def delayed_scaling_tensors(module) -> dict:
    """{"fwd.amax_history" / "fwd.scale" / "bwd...": the live tensor} of a module's delayed-scaling state (the
    history is ``[len, tensors]``, the scale ``[tensors]``; a GroupedLinear's tensors are GEMM-major); empty for
    other recipes."""
    out = {}
    for direction in ("fwd", "bwd"):
        state = module.fp8_meta.get(f"scaling_{direction}")
        for name in ("amax_history", "scale"):
            tensor = getattr(state, name, None)
            if isinstance(tensor, __import__("torch").Tensor):
                out[f"{direction}.{name}"] = tensor
    return out


def rebuild_quantizers(module) -> None:
    """TE 2.x quantizers hold views of the recipe-state tensors; rebuild them after the tensors moved."""
    quantizers = getattr(module, "quantizers", None)
    if not isinstance(quantizers, dict):
        return
    for key in ("scaling_fwd", "scaling_bwd"):
        state = module.fp8_meta.get(key)
        if state is not None and hasattr(state, "make_quantizers"):
            quantizers[key] = state.make_quantizers()


def gemms_per_forward(module) -> int:
    """TE's ``num_gemms`` for ``init_fp8_metadata`` of ``module``: a GroupedLinear's own count, else per class."""
    if type(module).__name__ == "GroupedLinear":
        return int(module.num_gemms)
    return GEMMS_PER_MODULE.get(type(module).__name__, 1)


# GroupedLinear reads its per-GEMM weights by name, one attribute per GEMM (discrete parameters, TE 2.x)
GROUPED_WEIGHT_SOURCES = (
    ("pytorch/module/grouped_linear.py", 'getattr(self, f"weight{i}") for i in range(self.num_gemms)'),
    ("pytorch/module/grouped_linear.py", "use_grouped_tensor: Optional[bool] = None"),
)


def grouped_views_missing() -> list[str]:
    """What running a GroupedLinear on weights it does not own needs of the installed TE and is not there."""
    from .. import missing_from_sources, package_root

    root = package_root("transformer_engine")
    if root is None:
        return ["transformer_engine not found"]
    return missing_from_sources(root, GROUPED_WEIGHT_SOURCES, "transformer-engine")


def grouped_linear_without_weights(te, num_gemms: int, in_features: int, out_features: int, dtype,
                                   bias: bool = False):
    """A ``te.GroupedLinear`` (discrete per-GEMM weights and biases, the split-quantize path) built on ``meta`` whose
    ``weight{i}`` (and ``bias{i}``) parameters are removed: it owns no parameter, only its FP8 state (``fp8_meta``,
    ``_extra_state``)."""
    module = te.GroupedLinear(num_gemms, in_features, out_features, bias=bias, params_dtype=dtype, device="meta",
                              use_grouped_tensor=False)
    for i in range(num_gemms):
        module._parameters.pop(f"weight{i}", None)
        module._parameters.pop(f"bias{i}", None)
    return module


def grouped_linear_on_views(module, weights, inp, m_splits, biases=None):
    """``module(inp, m_splits)`` with ``weights[i]`` (``[out, in]`` tensors, e.g. views of a 3-D expert parameter)
    as its ``weight{i}`` — and ``biases[i]`` as its ``bias{i}`` — for this call only; autograd carries each
    gradient back to the tensor it views."""
    handed = [(f"weight{i}", weight) for i, weight in enumerate(weights)]
    handed += [(f"bias{i}", bias) for i, bias in enumerate(biases or ())]
    for name, tensor in handed:
        module._parameters[name] = tensor
    try:
        return module(inp, m_splits)
    finally:
        for name, _ in handed:
            module._parameters.pop(name, None)


def te_version(versions: Mapping[str, str | None]) -> str | None:
    """The installed TE version in ``versions`` (distribution ``transformer-engine`` or ``transformer_engine``)."""
    return versions.get("transformer-engine") or versions.get("transformer_engine")


def meta_package_only(versions: Mapping[str, str | None]) -> str | None:
    """What is wrong when ``pip install transformer-engine`` (no ``[pytorch]``) gave TE's empty meta package — its
    Python with no compiled library and no ``transformer_engine_torch`` (TE then refuses at import: "Found empty
    `transformer-engine` meta package installed") — naming the fix; None otherwise. Read from metadata only; never
    said under the CPU rehearsal, whose kernel shim stands in for exactly those libraries."""
    from importlib import metadata

    from ... import settings

    installed = te_version(versions)
    if installed is None or settings.get(settings.REHEARSAL):
        return None
    try:
        metadata.version("transformer_engine_torch")
        return None
    except metadata.PackageNotFoundError:
        pass
    try:
        files = metadata.distribution("transformer-engine").files or ()
    except metadata.PackageNotFoundError:
        return None
    if any(str(f).endswith(".so") for f in files):
        return None  # a build from source: TE's libraries are in its own distribution
    return (f"transformer-engine {installed} is TE's meta package without its PyTorch extension "
            "(transformer_engine_torch is not installed): Transformer Engine refuses at import (\"Found empty "
            f"`transformer-engine` meta package installed\"), so FP8 cannot run; install "
            f"`pip install \"transformer-engine[pytorch]=={installed}\"` (or this package's `te` extra)")


def check(versions: Mapping[str, str | None]) -> list[str]:
    from .. import missing_from_sources, package_root

    installed = te_version(versions)
    root = package_root("transformer_engine")
    if installed is None and root is None:
        return []  # TE not installed: nothing to check
    version = f"transformer-engine {installed}"
    if root is None:
        return [f"{version}: transformer_engine not found"]
    meta_only = meta_package_only(versions)
    if meta_only:  # not a reason to refuse the set (its bf16 / FSDP2 x TP fixes still apply): said once, by name
        from ..._log import warn_user

        warn_user(f"accel_fp8_fix: {meta_only}")
    problems = missing_from_sources(root, _SOURCES, version)
    for what, alternatives in _FORKS:
        if all(missing_from_sources(root, (alternative,), version) for alternative in alternatives):
            places = " or ".join(f"{text!r} in {root.name}/{name}" for name, text in alternatives)
            problems.append(f"{version}: internal {what} is gone (neither {places})")
    if (root / _GUARD_FILE).exists():
        problems += missing_from_sources(root, _GUARD_SOURCES, version)
    return problems


# -- forks, decided once per installed TE (on first use) -------------------------------------------------


@functools.cache
def _quantization():
    """``transformer_engine.pytorch.quantization`` (TE 2.9+) or ``transformer_engine.pytorch.fp8`` (older)."""
    try:
        from transformer_engine.pytorch import quantization
    except ImportError:  # TE < 2.9
        from transformer_engine.pytorch import fp8 as quantization
    return quantization


@functools.cache
def _has_amax_reduction_group_autocast() -> bool:
    import inspect

    import transformer_engine.pytorch as te

    autocast = getattr(te, "autocast", None)
    return autocast is not None and "amax_reduction_group" in inspect.signature(autocast).parameters


def autocast_factory(te=None):
    """A function ``(enabled, recipe, group) -> context manager`` for the installed TE's autocast API (``te``:
    ``transformer_engine.pytorch``, imported when not given)."""
    if te is None:
        import transformer_engine.pytorch as te
    if _has_amax_reduction_group_autocast():
        autocast = te.autocast
        return lambda enabled, recipe, group: autocast(enabled=enabled, recipe=recipe, amax_reduction_group=group)
    return lambda enabled, recipe, group: te.fp8_autocast(enabled=enabled, fp8_recipe=recipe, fp8_group=group)


def fp8_global_state():
    """TE's ``FP8GlobalStateManager`` (``is_fp8_enabled()``, ``get_fp8_recipe()``)."""
    return _quantization().FP8GlobalStateManager


def align_size_for_quantization(recipe) -> int | None:
    """TE's own row alignment of grouped quantized GEMMs for ``recipe`` (``get_align_size_for_quantization``:
    16, MXFP8 32, NVFP4 128, a custom recipe's ``quantization_alignment``); None on a TE without it."""
    align = getattr(_quantization(), "get_align_size_for_quantization", None)
    return int(align(recipe)) if align is not None else None


def support_check(check_name: str):
    """TE's ``check_*_support`` function named ``check_name`` (``() -> (available, reason)``), or None for a TE
    without it."""
    return getattr(_quantization(), check_name, None)


def extension_is_cpu_rehearsal() -> bool:
    """TE's kernel extension here is the CPU rehearsal's shim (accel_fp8_fix.rehearsal.te_on_cpu), not CUDA's."""
    extension = sys.modules.get("transformer_engine_torch")
    return getattr(extension, "__name__", "").startswith("accel_fp8_fix.rehearsal.")


def device_compute_capability() -> tuple[int, int]:
    """The GPU's (major, minor) as TE sees it (raises without a usable CUDA device)."""
    from transformer_engine.pytorch.utils import get_device_compute_capability

    return get_device_compute_capability()


def fp8_gemms_tn_only() -> bool:
    """Whether this GPU's FP8 GEMMs take only the TN layout (sm89, sm90, sm120: TE's
    ``is_non_tn_fp8_gemm_supported()`` false), so every FP8 operand's leading dimension is the GEMM's k — in the
    weight-gradient GEMM, the tokens. True where no device answers, or on a TE without the function (the stricter
    rule)."""
    from transformer_engine.pytorch import utils

    supported = getattr(utils, "is_non_tn_fp8_gemm_supported", None)  # TE 2.x; older TEs ran TN-only GPUs
    if supported is None:
        return True
    try:
        return not supported()
    except (RuntimeError, AssertionError):  # no usable CUDA device
        return True


def fp8_checkpoint(function, *args, **kwargs):
    """``transformer_engine.pytorch.distributed.checkpoint``: recompute under the forward's FP8 recipe."""
    from transformer_engine.pytorch.distributed import checkpoint

    return checkpoint(function, *args, **kwargs)


# -- the extra-state pickle guard (TE 2.18+) --------------------------------------------------------------


def pickle_advisory(context: str) -> str | None:
    """TE's advisory refusing a pickled extra state for ``context``, or None for a TE without the guard."""
    try:
        from transformer_engine.pytorch._extra_state import extra_state_pickle_advisory
    except ImportError:  # TE < 2.18 has no guard (and no advisory)
        return None
    return extra_state_pickle_advisory(context)


def ignores_extra_state(data: bytes) -> bool:
    """TE's own classifier (2.18+) says this pickled extra state carries no state (stateless recipe); False
    for a TE without it."""
    try:
        from transformer_engine.pytorch._extra_state import _classify_extra_state_pickle, _PickledExtraStateAction
    except ImportError:
        return False
    return _classify_extra_state_pickle(data) is _PickledExtraStateAction.IGNORE


def _module_base():
    import importlib

    return importlib.import_module("transformer_engine.pytorch.module.base")


def has_pickle_guard() -> bool:
    """TE's ``set_extra_state`` (module/base.py) guards its ``pickle.loads`` (TE 2.18+)."""
    base = _module_base()
    return hasattr(base, "should_load_extra_state_pickle") and hasattr(base, "pickle")


@contextlib.contextmanager
def loading_decoded(payload):
    """While inside, TE's ``set_extra_state`` (module/base.py) finds its pickle guard answered and
    ``pickle.loads`` returning the already decoded ``payload``: TE's own code applies it. Restored on exit."""
    import pickle
    from types import SimpleNamespace

    base = _module_base()
    saved = {"should_load_extra_state_pickle": base.should_load_extra_state_pickle, "pickle": base.pickle}
    base.should_load_extra_state_pickle = lambda data, context: True
    base.pickle = SimpleNamespace(loads=lambda data: payload, dumps=pickle.dumps)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(base, name, value)


# -- FP8 all-gather (fixes/all_gather/fp8_all_gather.py): TE's Float8Tensor built from FSDP2-gathered bytes -----------------

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
