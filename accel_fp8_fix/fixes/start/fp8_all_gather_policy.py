"""When the FP8 all-gather (fixes/all_gather/fp8_all_gather.py) is asked for, and whether it can run — torch-free, so that
``accel-fp8-fix doctor --launch`` and ``te_recipe_kwargs`` refuse what ``prepare`` would refuse, with the same words.
"""

from __future__ import annotations

ENV = "ACCELERATE_FP8_ALL_GATHER"
SERVED_RECIPES = ("DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling")
REFUSED_RECIPES = {
    "MXFP8BlockScaling": "its 1x32 block scales are per row on the row-wise data and per column on the "
                         "column-wise data, so the transposed copy for dgrad cannot be derived from gathered "
                         "row-wise bytes; TE's MXFP8Tensor FSDP2 hooks exist only for quantized_model_init",
    "NVFP4BlockScaling": "FP4 data with 1x16 block scales and a second-level per-tensor scale, plus random "
                         "Hadamard transforms on the column-wise path; TE's hooks exist only for quantized_model_init",
}


def block_recipe_refusal(recipe) -> str | None:
    """Float8BlockScaling with 1x128 weight blocks (``w_block_scaling_dim=1``): the row-wise and column-wise copies
    have different scales, so the column-wise one cannot be derived from gathered row-wise bytes."""
    dim = getattr(recipe, "w_block_scaling_dim", 2)
    if dim != 2:
        return (f"the Float8BlockScaling recipe with w_block_scaling_dim={dim}: only 128x128 weight tiles "
                "(w_block_scaling_dim=2, the default) let TE derive the transposed copy from the gathered bytes")
    return None


class Fp8AllGatherError(ValueError):
    """The FP8 all-gather was asked for where it cannot run (named: the setting, the reason, the fix)."""


def requested(handler=None) -> tuple[bool, str]:
    """(on?, the setting that said so): ``te_recipe_kwargs(all_gather=...)`` first, then the environment."""
    from ... import settings
    from .handler_choices import all_gather_choice

    value = all_gather_choice(handler)
    if value is not None:
        return value == "fp8", "te_recipe_kwargs(all_gather)"
    value = settings.get(ENV)
    return value == "fp8", f"fp8_config `all_gather` / {ENV}"


def refusal(recipe=None, *, is_fsdp2: bool, cpu_offload: bool = False, versions=None) -> str | None:
    """Why the FP8 all-gather cannot be served (None: it can). Used at prepare and by ``doctor --launch``."""
    if not is_fsdp2:
        return ("it needs FSDP2 (fsdp_version: 2): without FSDP2 no weight is all-gathered (plain TP or DDP keep "
                "whole weights on each rank)")
    if cpu_offload:
        return "FSDP2 CPU offload copies the offloaded shard to the device as a plain tensor, without the hooks"
    name = type(recipe).__name__ if recipe is not None and not isinstance(recipe, str) else recipe
    if name in REFUSED_RECIPES:
        return f"the {name} recipe: {REFUSED_RECIPES[name]}"
    if name is not None and name not in SERVED_RECIPES:
        return f"the {name} recipe is not one it serves ({', '.join(SERVED_RECIPES)})"
    if versions is not None:
        from ...internals import torch_fsdp2, transformer_engine

        missing = transformer_engine.fp8_all_gather_missing(versions, name)
        if missing:
            return "the installed Transformer Engine lacks what it needs: " + "; ".join(missing)
        missing = torch_fsdp2.fp8_all_gather_missing(versions)
        if missing:
            return "the installed torch's FSDP2 lacks what it needs: " + "; ".join(missing)
    return None


def offloaded(plugin) -> bool:
    """Whether the FSDP2 plugin offloads parameters to the CPU (the FP8 all-gather cannot run there)."""
    offload = getattr(plugin, "cpu_offload", None)
    return type(offload).__name__ == "CPUOffloadPolicy" or bool(getattr(offload, "offload_params", False))
