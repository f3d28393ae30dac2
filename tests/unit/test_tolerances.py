"""tests/support/tolerances.py: the fast-accumulation term of the step-0 tolerances is a bound of the model's own
GEMMs (``tex.fast_accum_matmul``): a TP-split GEMM against the one-process GEMM."""

from __future__ import annotations

import math

import pytest
import torch

from accel_fp8_fix.rehearsal.te_on_cpu import tex
from support import tolerances

E4M3 = tex.DType.kFloat8E4M3


def _fp8_values(shape, scale, seed):
    torch.manual_seed(seed)
    return tex.fp8_bits_to_float(tex.cast_to_fp8(torch.randn(*shape) * scale, torch.ones(1), E4M3), E4M3)


@pytest.mark.parametrize("k,tp", [(64, 2), (128, 2), (128, 4), (1024, 4), (96, 2)])
def test_the_split_k_term_bounds_the_model_s_row_parallel_difference(monkeypatch, k, tp):
    """Each TP rank fast-accumulates its K/tp slice, the slices are summed in fp32 (the all-reduce), against one
    fast-accumulated GEMM over the whole K: off by at most the term times sum_k |x_k w_k| (first order)."""
    monkeypatch.setenv(tex.ENV_FAST_ACCUM, "1")
    x, w = _fp8_values((8, k), 20.0, 0), _fp8_values((k, 6), 10.0, 1)
    whole = tex.fast_accum_matmul(x, w).double()
    part = k // tp
    split = sum(tex.fast_accum_matmul(x[:, r * part:(r + 1) * part], w[r * part:(r + 1) * part]).double()
                for r in range(tp))
    scale = x.double().abs() @ w.double().abs()
    term = tolerances.tp_split_k_bound(tp, [k])
    assert term == (math.ceil(k / 32) + math.ceil(k / (32 * tp))) * 2.0 ** -13
    assert bool(((whole - split).abs() <= term * scale + 1e-6 * scale).all())  # (+ the fp32 all-reduce's rounding)
    assert not torch.equal(whole, split)  # the model does cut differently: the check is not vacuous


def test_no_term_without_the_model_or_without_tp(monkeypatch):
    monkeypatch.setenv(tex.ENV_FAST_ACCUM, "0")
    assert tolerances.tp_split_k_bound(4, [128]) == 0.0
    assert tolerances.step0_rel(2e-4, 4, [128]) == 2e-4
    monkeypatch.setenv(tex.ENV_FAST_ACCUM, "1")
    assert tolerances.tp_split_k_bound(1, [128]) == 0.0  # FSDP2 / HSDP: the reference's K, the same cuts
    assert tolerances.step0_rel(1e-5, 2, [64, 128]) == pytest.approx(1e-5 + (3 + 6) * 2.0 ** -13)


def test_row_parallel_ks_of_a_transformers_config():
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    assert tolerances.row_parallel_ks(config) == [64, 128, 64, 128]
