"""FP8 GEMM shapes, checked where they are decided (failure A11 in docs/failures.md).

Transformer Engine runs a Linear's GEMMs in FP8 only when the tensors the kernel sees — TP-local
shards, this rank's tokens — fit cuBLAS' FP8 layout rule (``assert_dim_for_fp8_exec`` in TE's
``module/linear.py``): for the input and the weight, the product of the leading dims divisible by 8
and the last dim by 16. TE checks at the first FP8 GEMM and says neither which module nor what to do.

- at conversion, :func:`local_dims_fit` decides on the TP-local weight shape (not the global one);
- at every FP8 forward, :func:`install_token_check` raises, before TE's own assertion, a ``ValueError``
  naming the module, the shape this rank fed it and the remedy (pad the batch).

Chosen over padding (TE's ``Fp8Padding``): padding would copy every activation of every layer on every
step to hide a data-pipeline choice that one ``pad_to_multiple_of=8`` fixes for free.
"""

from __future__ import annotations

import math

FP8_LEADING_MULTIPLE = 8
FP8_LAST_MULTIPLE = 16


def local_dims(in_features: int, out_features: int, mode: str | None, tp_size: int) -> tuple[int, int]:
    """(in, out) of the weight shard this rank's kernel sees under TE's TP ``mode``."""
    if mode == "column":
        return in_features, out_features // tp_size
    if mode == "row":
        return in_features // tp_size, out_features
    return in_features, out_features


def local_dims_fit(in_local: int, out_local: int) -> bool:
    """Both weight dims a multiple of 16 (the weight is an FP8 GEMM operand in forward and backward)."""
    return in_local % FP8_LAST_MULTIPLE == 0 and out_local % FP8_LAST_MULTIPLE == 0


def _fp8_on() -> bool:
    try:
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager
    except ImportError:  # TE < 2.9
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
    return FP8GlobalStateManager.is_fp8_enabled()


class _TokenCheck:
    def __init__(self, name: str):
        self.name = name

    def __call__(self, module, args):
        if not args or not hasattr(args[0], "shape") or not _fp8_on():
            return None
        shape = tuple(args[0].shape)
        leading = math.prod(shape[:-1]) if len(shape) > 1 else 1
        if leading % FP8_LEADING_MULTIPLE == 0 and shape[-1] % FP8_LAST_MULTIPLE == 0:
            return None
        raise ValueError(
            f"accel_fp8_fix: {self.name} ({type(module).__name__}) got an input of shape {list(shape)} on this "
            f"rank: Transformer Engine's FP8 GEMMs need the tokens per rank (product of the leading dims, "
            f"here {leading}) to be a multiple of {FP8_LEADING_MULTIPLE} and the feature dim (here {shape[-1]}) "
            f"a multiple of {FP8_LAST_MULTIPLE}. Pad each rank's batch so that batch x sequence is a multiple "
            f"of {FP8_LEADING_MULTIPLE} (e.g. tokenizer / collator pad_to_multiple_of={FP8_LEADING_MULTIPLE}), "
            "or keep this module out of FP8."
        )


def install_token_check(module, name: str) -> None:
    module.register_forward_pre_hook(_TokenCheck(name))
