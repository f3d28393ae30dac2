"""TE's modules: the FP8 state a module holds (``fp8_meta``, its recipe state and quantizers), TE's ``num_gemms``
per forward of a module class, and ``GroupedLinear`` on weights it does not own.

- ``GEMMS_PER_MODULE``: TE's ``num_gemms`` per forward of a module class (``init_fp8_metadata``);
  :func:`gemms_per_forward` (a ``GroupedLinear``'s own ``num_gemms``);
- ``GroupedLinear``'s per-GEMM weights ``weight0`` .. ``weight{n-1}`` (read with ``getattr`` by
  ``_get_weight_tensors``): :func:`grouped_linear_without_weights` builds one that owns none,
  :func:`grouped_linear_on_views` runs it on tensors it does not own (MoE experts, fixes/convert/moe_experts.py).
"""

from __future__ import annotations

GEMMS_PER_MODULE = {"LayerNormMLP": 2}  # TE's num_gemms per forward; 1 for Linear / LayerNormLinear

# -- TE's FP8 state layout on a module (fixes/ reach it only through these; tests/unit/test_layout.py) ----------

FP8_STATE_ATTRS = ("fp8_meta",)  # the attributes of a TE module that hold its FP8 state tensors


def has_fp8_state(module) -> bool:
    """A TE module with FP8 state (``fp8_meta``) that ``init_fp8_metadata`` creates."""
    return hasattr(module, "fp8_meta") and hasattr(module, "init_fp8_metadata")


def take_fsdp2_weight_path(model) -> None:
    """Every module of ``model`` with FP8 state (``fp8_meta``) takes TE's FSDP2 weight path (``_is_fsdp2``,
    module/base.py): the FP8 weight not saved in forward but re-quantized in backward with the scale updated at
    autocast exit — what a one-process reference does to compute as the FSDP2 ranks do (accel_fp8_fix.testing)."""
    for module in model.modules():
        if hasattr(module, "fp8_meta"):
            module._is_fsdp2 = True


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

