"""What a model uses of transformers' internals, checked before ``prepare`` touches it.

Each fix that takes over or mirrors a transformers internal names it in a feature of
``internals/transformers_features.py``; a feature is verified when its sources hash to a tested release's. Here the
model is read (its TP styles, packed experts, expert parallelism, loading) and every feature it would use must be
verified, or the patched ``prepare`` refuses by name before anything is sharded or converted — on a transformers
newer than the tested window, a model that uses nothing that changed loses nothing.
(``replicated_with_grad_allreduce`` is checked where it is taken over, in any precision: fixes/convert/tp.py.)
"""

from __future__ import annotations

from torch import nn

from ...internals import transformers_ep, transformers_features, transformers_tp
from .moe_experts import is_packed_experts


def features_used(model: nn.Module) -> dict[str, list[str]]:
    """{feature: [the modules (or the model) that use it]} for an FP8 prepare of ``model``."""
    used: dict[str, list[str]] = {}

    def add(feature, name):
        used.setdefault(feature, []).append(name or type(model).__name__)

    if getattr(model, "is_distributed_loading_by_transformers", False):
        add("distributed_loading", "")
    for name, module in model.named_modules():
        style = type(transformers_tp.tp_style(module)).__name__
        if style in transformers_tp.KNOWN_STYLES:
            add("tp_styles", name)
        if is_packed_experts(module) and hasattr(module, "has_gate"):
            add("experts_implementation", name)
            if style == transformers_tp.EXPERTS_STYLE:
                add("moe_tp_experts", name)
                add("tp_styles", name)  # its forward is the one transformers' TP forward calls
            if transformers_ep.dispatch(module) is not None:
                add("expert_parallel", name)
    return used


def check_model(model: nn.Module) -> None:
    """Every transformers feature ``model`` would use verified, or :class:`UnverifiedInternalError` naming it."""
    for feature, users in features_used(model).items():
        transformers_features.require(feature, users)
