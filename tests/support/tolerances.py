"""What the rehearsal's fast-accumulation model (``ACCEL_FP8_FIX_REHEARSAL_FAST_ACCUM=1``, docs/rehearsal.md
"Hopper FP8 fast accumulation") adds to a step-0 tolerance, derived from the model's own bound.

The model cuts a forward FP8 GEMM's running sum to 1 + 13 significant bits (toward zero) once per 32 of K: each
cut removes less than 2**-13 of the sum, so a GEMM over K comes out low by less than ceil(K/32) * 2**-13
(relative, first order). A run whose GEMMs see the reference's K cuts the same sums as the reference and agrees
with it as it does without the model (FSDP2, HSDP: the batch is split, K is not). Tensor parallelism splits the K
of the row-parallel GEMMs (``o_proj``, ``down_proj``): each TP rank cuts its own K/tp partial sum
(ceil(K/(32 tp)) times) before the fp32 all-reduce, the reference cuts the whole sum (ceil(K/32) times), so the
two outputs differ by less than (ceil(K/32) + ceil(K/(32 tp))) * 2**-13 relative. Each such output is added to a
pre-norm decoder's residual stream; to first order the relative changes of the GEMMs on the forward path add up,
and the loss is taken to move by no more than its stream does (relative gain <= 1; measured, the largest step-0
deviation under the model, Gemma 3 on TP 4, is 2.2e-4 against a bound of 2.15e-3: docs/rehearsal.md,
``scripts/fast_accum_deviations.py``). The added tolerance is that sum; without the model, or without TP, it is 0
and the tolerance is the exact one.
"""

from __future__ import annotations

import math


def _tex():
    from accel_fp8_fix.rehearsal.te_on_cpu import tex  # (torch: imported when a tolerance is asked for)

    return tex


def fast_accum_on() -> bool:
    """Whether this process (and so the ranks it starts, which inherit its environment) runs the model."""
    return _tex().fast_accum_enabled()


def tp_split_k_bound(tp: int, row_parallel_ks) -> float:
    """The bound above for the row-parallel GEMMs on the forward path, given by their K (full, unsplit)."""
    if tp <= 1 or not fast_accum_on():
        return 0.0
    tex = _tex()
    cut, chunk = 2.0 ** -tex.FAST_ACCUM_MANTISSA_BITS, tex.FAST_ACCUM_K_CHUNK  # the most one cut removes; K per cut
    return sum((math.ceil(k / chunk) + math.ceil(k / (chunk * tp))) * cut for k in row_parallel_ks)


def row_parallel_ks(config) -> list[int]:
    """A transformers decoder's row-parallel GEMMs by K: ``o_proj`` (heads x head_dim) and the MLP's
    ``down_proj`` (``intermediate_size``: the MoE configs' experts and shared experts are narrower) in every layer."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return [config.num_attention_heads * head_dim, config.intermediate_size] * config.num_hidden_layers


def step0_rel(exact: float, tp: int, row_parallel_ks) -> float:
    """A step-0 relative tolerance: ``exact`` (the exact-GEMM tolerance) plus the fast-accumulation bound."""
    return exact + tp_split_k_bound(tp, row_parallel_ks)
