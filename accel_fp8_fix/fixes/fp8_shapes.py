"""FP8 GEMM shapes, checked where they are decided (failure A11 in docs/failures.md).

Transformer Engine runs a Linear's GEMMs in FP8 only when the tensors the kernel sees — TP-local
shards, this rank's tokens — fit cuBLAS' FP8 layout rule (``assert_dim_for_fp8_exec`` in TE's
``module/linear.py``): for the input and the weight, the product of the leading dims divisible by 8
and the last dim by 16. TE checks at the first FP8 GEMM and says neither which module nor what to do.

- at conversion, :func:`local_dims_fit` decides on the TP-local weight shape (not the global one);
- at every FP8 forward, :func:`install_token_check` raises, before TE's own assertion, a ``ValueError``
  naming the module, the shape this rank fed it and the remedy (pad the batch); MXFP8 needs multiples
  of 32 (its scale blocks) instead of 8 / 16.

Chosen over padding (TE's ``Fp8Padding``): padding would copy every activation of every layer on every
step to hide a data-pipeline choice that one ``pad_to_multiple_of=8`` fixes for free.
"""

from __future__ import annotations

import math

FP8_LEADING_MULTIPLE = 8
FP8_LAST_MULTIPLE = 16
MXFP8_MULTIPLE = 32  # MXFP8 scales 32-element blocks along both dims (MXFP8Quantizer::get_scale_shape)
NVFP4_MULTIPLE = 16  # NVFP4 scales 16-element blocks (NVFP4Quantizer.is_quantizable: both dims)
BLOCK_TOKENS_MULTIPLE = 16  # FP8 block scaling on Hopper: the wgrad GEMM sums over tokens and cuBLAS needs k % 16


def _is(recipe, kind: str) -> bool:
    return recipe is not None and getattr(recipe, kind, lambda: False)()


def recipe_multiples(recipe) -> tuple[int, int]:
    """(tokens, feature dim) multiples ``recipe``'s GEMM operands need."""
    if _is(recipe, "mxfp8"):
        return MXFP8_MULTIPLE, MXFP8_MULTIPLE
    if _is(recipe, "nvfp4"):
        return NVFP4_MULTIPLE, max(NVFP4_MULTIPLE, FP8_LAST_MULTIPLE)
    if _is(recipe, "float8_block_scaling"):
        return BLOCK_TOKENS_MULTIPLE, FP8_LAST_MULTIPLE
    return FP8_LEADING_MULTIPLE, FP8_LAST_MULTIPLE


def local_dims(in_features: int, out_features: int, mode: str | None, tp_size: int) -> tuple[int, int]:
    """(in, out) of the weight shard this rank's kernel sees under TE's TP ``mode``."""
    if mode == "column":
        return in_features, out_features // tp_size
    if mode == "row":
        return in_features // tp_size, out_features
    return in_features, out_features


def local_dims_fit(in_local: int, out_local: int, multiple: int = FP8_LAST_MULTIPLE) -> bool:
    """Both weight dims a multiple of 16 (the weight is an FP8 GEMM operand in forward and backward), or of
    32 for MXFP8 (``weight_multiple(recipe)``)."""
    return in_local % multiple == 0 and out_local % multiple == 0


def weight_multiple(recipe) -> int:
    """What each weight dim must be a multiple of for ``recipe``'s GEMMs."""
    return max(recipe_multiples(recipe))


def _fp8_multiples() -> tuple[int, int] | None:
    """(leading, last) multiples the current FP8 recipe needs, or None when FP8 is off."""
    from ..internals.transformer_engine import fp8_global_state

    FP8GlobalStateManager = fp8_global_state()
    if not FP8GlobalStateManager.is_fp8_enabled():
        return None
    return recipe_multiples(FP8GlobalStateManager.get_fp8_recipe())


class _TokenCheck:
    def __init__(self, name: str):
        self.name = name

    def __call__(self, module, args):
        multiples = _fp8_multiples() if args and hasattr(args[0], "shape") else None
        if multiples is None:
            return None
        lead_m, last_m = multiples
        shape = tuple(args[0].shape)
        leading = math.prod(shape[:-1]) if len(shape) > 1 else 1
        if leading % lead_m == 0 and shape[-1] % last_m == 0:
            return None
        raise ValueError(
            f"accel_fp8_fix: {self.name} ({type(module).__name__}) got an input of shape {list(shape)} on this "
            f"rank: Transformer Engine's FP8 GEMMs need the tokens per rank (product of the leading dims, "
            f"here {leading}) to be a multiple of {lead_m} and the feature dim (here {shape[-1]}) "
            f"a multiple of {last_m}. Pad each rank's batch so that batch x sequence is a multiple "
            f"of {lead_m} (e.g. tokenizer / collator pad_to_multiple_of={lead_m}), "
            "or keep this module out of FP8."
        )


def install_token_check(module, name: str) -> None:
    module.register_forward_pre_hook(_TokenCheck(name))
