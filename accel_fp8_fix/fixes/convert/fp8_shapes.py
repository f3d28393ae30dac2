"""FP8 GEMM shapes, checked where they are decided (failure A11 in docs/failures.md).

Transformer Engine runs a Linear's GEMMs in FP8 only when the tensors the kernel sees — TP-local
shards, this rank's tokens — fit cuBLAS' FP8 layout rule (``assert_dim_for_fp8_exec`` in TE's
``module/linear.py``): for the input and the weight, the product of the leading dims divisible by 8
and the last dim by 16. TE checks at the first FP8 GEMM and says neither which module nor what to do.

- at conversion, :func:`local_dims_fit` decides on the TP-local weight shape (not the global one);
- at every FP8 forward, :func:`install_token_check` raises, before TE's own assertion, a ``ValueError``
  naming the module, the shape this rank fed it and the remedy (pad the batch); MXFP8 needs multiples
  of 32 (its scale blocks) instead of 8 / 16. A forward whose backward computes the weight gradient (grad
  enabled, a weight that requires it) on a GPU whose FP8 GEMMs are TN-only (Ada, Hopper: TE's
  ``is_non_tn_fp8_gemm_supported()`` false) needs the tokens a multiple of 16 too: that GEMM's k is the
  tokens, and cuBLASLt's FP8 leading dimension must divide by 16 — TE refuses it in backward ("Leading
  dimension requirement on A for FP8 GEMM. Caller must pad."), after the forward has run. The package refuses
  it by name when the backward reaches the module (a gradient hook on its output), so a forward that never
  runs backward (an evaluation under grad mode) is not refused; a forward that fails TE's own rule while
  training asks for the training multiple at once.

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
WGRAD_TOKENS_MULTIPLE = 16  # cuBLASLt FP8: lda % 16; the weight-gradient GEMM's k (its lda on TN-only GPUs) = tokens


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
    from ...internals.transformer_engine import fp8_global_state

    FP8GlobalStateManager = fp8_global_state()
    if not FP8GlobalStateManager.is_fp8_enabled():
        return None
    return recipe_multiples(FP8GlobalStateManager.get_fp8_recipe())


class _TokenCheck:
    """The forward pre-hook: TE's forward rule refused here, by name; a forward that passes it but whose weight
    gradient TE will refuse (the training rule) is marked, and :class:`_TrainingTokenCheck` refuses it when the
    backward reaches this module — only a step that runs backward is refused, as TE refuses it."""

    def __init__(self, name: str):
        from ...internals.transformer_engine import fp8_gemms_tn_only

        self.name = name
        self.pending: str | None = None
        self.tn_only = fp8_gemms_tn_only()  # asked once, eagerly (a compiled forward must not trace the device query)

    def __call__(self, module, args):
        self.pending = None
        multiples = _fp8_multiples() if args and hasattr(args[0], "shape") else None
        if multiples is None:
            return None
        lead_m, last_m = multiples
        shape = tuple(args[0].shape)
        leading = math.prod(shape[:-1]) if len(shape) > 1 else 1
        train_m = lead_m
        if self.tn_only and lead_m % WGRAD_TOKENS_MULTIPLE and _computes_weight_gradient(module):
            train_m = math.lcm(lead_m, WGRAD_TOKENS_MULTIPLE)
        if leading % lead_m == 0 and shape[-1] % last_m == 0:
            if leading % train_m:
                self.pending = self._message(module, shape, leading, train_m, last_m, training=True)
            return None
        raise ValueError(self._message(module, shape, leading, train_m, last_m, training=train_m != lead_m))

    def _message(self, module, shape, leading, lead_m, last_m, training) -> str:
        why = (" (in training: the weight-gradient GEMM sums over the tokens, and this GPU's FP8 GEMMs, TN only, "
               "need that dim a multiple of 16 — Transformer Engine refuses it in backward)") if training else ""
        return (
            f"accel_fp8_fix: {self.name} ({type(module).__name__}) got an input of shape {list(shape)} on this "
            f"rank: Transformer Engine's FP8 GEMMs need the tokens per rank (product of the leading dims, "
            f"here {leading}) to be a multiple of {lead_m}{why} and the feature dim (here {shape[-1]}) "
            f"a multiple of {last_m}. Pad each rank's batch so that batch x sequence is a multiple "
            f"of {lead_m} (e.g. tokenizer / collator pad_to_multiple_of={lead_m}), "
            "or keep this module out of FP8."
        )


class _TrainingTokenCheck:
    """The forward hook: where the pre-hook marked the step, the output's gradient hook raises the refusal — the
    backward stops there, before TE's weight-gradient GEMM fails without naming the module."""

    def __init__(self, check: _TokenCheck):
        self.check = check

    def __call__(self, module, args, output):
        message, self.check.pending = self.check.pending, None
        if message is not None and getattr(output, "requires_grad", False):
            def refuse(_grad):
                raise ValueError(message)

            output.register_hook(refuse)
        return None


def _computes_weight_gradient(module) -> bool:
    """Whether this forward's backward computes a weight gradient: grad enabled and a weight (a parameter of two
    or more dims) that requires it — TE skips the weight-gradient GEMM of a frozen weight."""
    import torch

    return torch.is_grad_enabled() and any(p.requires_grad and p.dim() >= 2
                                           for p in module.parameters(recurse=False))


def install_token_check(module, name: str) -> None:
    check = _TokenCheck(name)
    module.register_forward_pre_hook(check)
    module.register_forward_hook(_TrainingTokenCheck(check))
