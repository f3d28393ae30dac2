"""TE's recipes and what decides them: the autocast API, ``FP8GlobalStateManager`` and the ``check_*_support``
functions, the GPU's compute capability and GEMM layouts, TE's FP8-aware activation checkpoint.

- autocast: ``te.autocast(recipe=, amax_reduction_group=)`` (TE 2.9+) or ``te.fp8_autocast(fp8_recipe=,
  fp8_group=)`` (older) — :func:`autocast_factory`;
- ``FP8GlobalStateManager`` and the ``check_*_support`` functions: in ``transformer_engine.pytorch.quantization``
  (TE 2.9+) or ``.fp8`` (older) — :func:`fp8_global_state`, :func:`support_check`;
- ``transformer_engine.pytorch.utils.get_device_compute_capability`` — :func:`device_compute_capability`;
- ``transformer_engine.pytorch.distributed.checkpoint`` (the FP8-aware activation checkpoint) —
  :func:`fp8_checkpoint`.

Each fork is resolved on first use and kept.
"""

from __future__ import annotations

import functools
import sys

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

