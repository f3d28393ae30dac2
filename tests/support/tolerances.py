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

import contextlib
import math
import os


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


# -- TF32: TE's all-fp32 GEMMs on the device (tex.round_to_tf32, docs/rehearsal.md "TF32") ---------------------------
# TF32 keeps 10 fraction bits: half an ulp to nearest, a whole one truncated. Written here, not read from the shim,
# so that the GPU tests use it without importing the rehearsal (tests/rehearsal/test_te_on_cpu_tf32.py: they agree).
TF32_UNIT_ROUNDOFF = {"rna": 2.0 ** -11, "truncate": 2.0 ** -10}


def tf32_rel(gemms: int, mode: str = "rna") -> float:
    """The relative (norm) tolerance of a tensor computed through ``gemms`` all-fp32 TE GEMMs run in TF32 against
    the same computation in fp32. A TF32 GEMM rounds each operand element to ``u`` relative (2**-11 to nearest,
    2**-10 truncated), so each product moves by less than 2u of itself; to first order the GEMMs on a tensor's path
    add. Norm-wise, random-signed products give ~0.8 u a GEMM (measured: 4.4e-4 to 5.1e-4 on the MoE experts'
    outputs, two GEMMs deep, with u = 4.9e-4): 2u a GEMM holds that with room, and a tensor computed in plain fp32
    (a missing TF32) or an O(1) wiring error are told apart from it by the exact check run with TF32 off."""
    return gemms * 2 * TF32_UNIT_ROUNDOFF[mode]


def tf32_mode() -> str:
    """The TF32 rounding this process (and the ranks it starts) applies: "rna", "truncate" or "off"."""
    return _tex().tf32_mode()


ENV_TF32 = "ACCEL_FP8_FIX_REHEARSAL_TF32"  # tex.ENV_TF32


@contextlib.contextmanager
def tf32_set(mode: str | None):
    """The shim's TF32 rounding of all-fp32 GEMMs set to ``mode`` for the block (read at each GEMM; a pooled rank
    gets its setting back after); ``None`` leaves it as it is. A wiring check that compares an fp32 TE path with
    torch's own bit for bit (or to summation order) runs with "off"."""
    if mode is None:
        yield
        return
    before = os.environ.get(ENV_TF32)
    os.environ[ENV_TF32] = mode
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ENV_TF32, None)
        else:
            os.environ[ENV_TF32] = before
