"""TF32 in the kernel shim's all-fp32 GEMMs, as TE runs them on the device (issue 48 item 4).

TE 2.20's ``cublaslt_gemm.cu`` sets ``CUBLAS_COMPUTE_32F_FAST_TF32`` when A, B and D are all fp32 ("Use TF32 only
for pure FP32 GEMM"): on a GPU of capability >= 8.0 both operands are rounded to TF32 and the products accumulate
in fp32. The reference here is written from the format (Python floats, ``struct``), not from the shim's bit trick.
"""

from __future__ import annotations

import math
import struct

import pytest
import torch

from accel_fp8_fix.rehearsal.te_on_cpu import tex
from support import launcher
from support import tolerances


def _tf32_reference(value: float, mode: str) -> float:
    """The TF32 neighbour of an fp32 value: 10 fraction bits; "rna" to nearest with ties away from zero."""
    if not math.isfinite(value) or value == 0.0:
        return value
    mantissa, exponent = math.frexp(abs(value))  # |value| = mantissa * 2**exponent, 0.5 <= mantissa < 1
    if exponent - 1 < -126:  # fp32 subnormal: the grid is fixed at 2**-149, TF32 keeps 10 of its fraction bits
        exponent = -125
    step = 2.0 ** (exponent - 11)  # the spacing of 11 significant bits at this binade
    units = abs(value) / step
    kept = math.floor(units) if mode == "truncate" else math.floor(units + 0.5)
    out = kept * step
    out = struct.unpack("<f", struct.pack("<f", out))[0] if out <= 3.4028234663852886e38 else math.inf
    return math.copysign(out, value)


EDGES = [1.0, 1.0 + 2**-10, 1.0 + 2**-11, 1.0 + 3 * 2**-11, 1.0 + 2**-11 + 2**-23, 1.0 + 2**-11 - 2**-23,
         -(1.0 + 2**-11), 3.4028234663852886e38, -3.4028234663852886e38, 2.0**-126, 2.0**-149, 3 * 2.0**-140,
         1.17e-38, 0.0, -0.0, 65504.0, 448.0, 1e-3, -7.3e5]


@pytest.mark.parametrize("mode", ["rna", "truncate"])
def test_round_to_tf32_matches_the_format_at_ties_extremes_and_subnormals(mode):
    torch.manual_seed(0)
    values = torch.tensor(EDGES + (torch.randn(2000) * 10.0 ** torch.randint(-30, 30, (2000,))).tolist(),
                          dtype=torch.float32)
    rounded = tex.round_to_tf32(values, mode)
    want = torch.tensor([_tf32_reference(v, mode) for v in values.tolist()], dtype=torch.float32)
    assert torch.equal(rounded, want)
    assert bool(((rounded.view(torch.int32) & 0x1FFF) == 0).all())  # 13 low fraction bits clear
    special = torch.tensor([math.inf, -math.inf, math.nan, struct.unpack("<f", struct.pack("<I", 0x7F800001))[0]])
    out = tex.round_to_tf32(special, mode)
    assert out[0] == math.inf and out[1] == -math.inf and bool(out[2:].isnan().all())  # a NaN never turns inf


def test_rna_rounds_ties_away_from_zero_and_truncate_toward_zero():
    tie = 1.0 + 2**-11  # half way between 1 and 1 + 2**-10
    assert tex.round_to_tf32(torch.tensor([tie, -tie]), "rna").tolist() == [1.0 + 2**-10, -(1.0 + 2**-10)]
    assert tex.round_to_tf32(torch.tensor([tie, -tie]), "truncate").tolist() == [1.0, -1.0]
    # the largest fp32 rounds away to inf (cvt.rna's overflow), truncation keeps it finite
    assert tex.round_to_tf32(torch.tensor([3.4028234663852886e38]), "rna").item() == math.inf


def _gemm(a, b, d_dtype=None, out=None):
    """TE's fprop layout: D [M, N] = B [M, K] @ A [N, K]^T."""
    result, *_ = tex.generic_gemm(a, True, b, False, out, None, d_dtype, None, tex.DType.kFloat32, False, None,
                                  False, torch.empty(0), 0, False, False)
    return result


def test_an_all_fp32_gemm_rounds_both_operands_to_tf32_and_accumulates_in_fp32(monkeypatch):
    monkeypatch.delenv(tex.ENV_TF32, raising=False)
    monkeypatch.delenv("ACCEL_FP8_FIX_REHEARSAL_TARGET", raising=False)
    monkeypatch.delenv("ACCEL_FP8_FIX_CPU_TE_ARCH", raising=False)
    torch.manual_seed(1)
    w, x = torch.randn(24, 512), torch.randn(16, 512)
    exact = x @ w.t()
    tf32 = tex.round_to_tf32(x, "rna") @ tex.round_to_tf32(w, "rna").t()
    tex.reset_stats()
    assert torch.equal(_gemm(w, x), tf32) and not torch.equal(tf32, exact)
    assert tex.stats()["tf32_gemms"] == 1
    # fp32 operands into a bf16 or fp16 D: CUBLAS_COMPUTE_32F, no TF32
    assert torch.equal(_gemm(w, x, tex.DType.kBFloat16).float(), exact.bfloat16().float())
    d = torch.empty(16, 24, dtype=torch.bfloat16)
    _gemm(w, x, out=d)
    assert torch.equal(d, exact.bfloat16())
    # bf16 operands: no TF32 either
    assert torch.equal(_gemm(w.bfloat16(), x.bfloat16()).float(), (x.bfloat16().float() @ w.bfloat16().float().t())
                       .bfloat16().float())
    assert tex.stats()["tf32_gemms"] == 1
    # the error TF32 adds is within its bound: 2 u |x| |w| per output (u = 2**-11 for rna), plus fp32 accumulation
    bound = 2 * tex.TF32_UNIT_ROUNDOFF["rna"] * (x.abs() @ w.abs().t()) * (1 + 1e-5)
    assert bool(((tf32 - exact).abs() <= bound).all())
    monkeypatch.setenv(tex.ENV_TF32, "off")
    assert torch.equal(_gemm(w, x), exact)
    monkeypatch.setenv(tex.ENV_TF32, "truncate")
    assert torch.equal(_gemm(w, x), tex.round_to_tf32(x, "truncate") @ tex.round_to_tf32(w, "truncate").t())
    monkeypatch.setenv(tex.ENV_TF32, "tf32")
    with pytest.raises(ValueError, match="ACCEL_FP8_FIX_REHEARSAL_TF32='tf32'"):
        _gemm(w, x)


def _fp32_linear(rank, world_size):
    from accel_fp8_fix.rehearsal import te_on_cpu

    te_on_cpu.install()
    import transformer_engine.pytorch as te

    torch.manual_seed(0)
    layer = te.Linear(256, 64, bias=False)
    x = torch.randn(32, 256, requires_grad=True)
    te_on_cpu.reset_stats()
    y = layer(x)
    y.sum().backward()
    rounded = tex.round_to_tf32
    w = layer.weight.detach()
    grad = torch.ones(32, 64)
    return {"tf32_gemms": te_on_cpu.stats()["tf32_gemms"],
            "fprop": torch.equal(y.detach(), rounded(x.detach()) @ rounded(w).t()),
            "dgrad": torch.equal(x.grad, rounded(grad) @ rounded(w)),
            "wgrad": torch.equal(layer.weight.grad, rounded(grad).t() @ rounded(x.detach()))}


def test_tes_fp32_linear_runs_its_three_gemms_in_tf32():
    (result,) = launcher.run(_fp32_linear, 1, env={"ACCEL_FP8_FIX_CPU_TE_ARCH": "sm90"}, timeout=180)
    assert result == {"tf32_gemms": 3, "fprop": True, "dgrad": True, "wgrad": True}


def test_the_tolerances_module_and_the_shim_agree_on_tf32s_unit_roundoff():
    assert tolerances.TF32_UNIT_ROUNDOFF == tex.TF32_UNIT_ROUNDOFF and tolerances.ENV_TF32 == tex.ENV_TF32
    assert tolerances.tf32_rel(2) == 4 * 2.0**-11 and tolerances.tf32_rel(1, "truncate") == 2 * 2.0**-10
