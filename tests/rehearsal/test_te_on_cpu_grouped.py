"""Grouped ops of the CPU kernel shim (accel_fp8_fix.rehearsal.te_on_cpu.grouped), issue 19: MoE experts in FP8.

Kernels against references written here from TE's sources: ``split_quantize`` (``extensions/cast.cpp``: one
quantization per split) against a per-split reference of each quantizer kind's cast (FP8 grid built from the bit
layout, round to nearest even, saturating; scales as ``recipe_common.cuh`` / ``ptx::float_to_e8m0`` compute them);
``te_general_grouped_gemm`` (``extensions/gemm.cpp``, one cuBLAS GEMM per group) equal to one single GEMM per group
bit for bit, and to an fp64 product of the operands' dequantized values within the fp32 accumulation bound, for TE's
fprop (TN), dgrad (NN) and wgrad (NT) layouts with an empty group. Then ``te.GroupedLinear`` forward + backward under
every recipe against E ``te.Linear`` modules holding the same weights, and against fp32. TE's Python runs in one
fresh rank per architecture: sm90 (Hopper: delayed / current / block scaling, FP8 off) and sm100 (MXFP8).
"""

from __future__ import annotations

import math
import struct

import pytest
import torch

from support import launcher
from support import scenarios

SPLITS = [32, 0, 48, 16]  # tokens per expert, one expert without tokens; multiples of 16 (FP8 GEMM rule)
SPLITS_MX = [64, 0, 96, 32]  # MXFP8: rows in blocks of 32
FP8_MAX = 448.0


def _f32(value: float) -> float:
    return struct.unpack("<f", struct.pack("<f", value))[0]


# -- E4M3 from its bit layout: code -> value, and round to nearest even (ties to the even code), satfinite -------
def _e4m3_table() -> torch.Tensor:
    values = []
    for code in range(256):
        sign, e, m = code >> 7, (code >> 3) & 0xF, code & 0x7
        if e == 0xF and m == 0x7:
            values.append(float("nan"))
            continue
        v = (m / 8) * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
        values.append(-v if sign else v)
    return torch.tensor(values, dtype=torch.float64)


E4M3_VALUES = _e4m3_table()


def _decode(bits: torch.Tensor) -> torch.Tensor:
    return E4M3_VALUES[bits.long()].float()


def _round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """fp32 values -> nearest E4M3 value (ties to the even code), |x| saturated to 448, NaN kept."""
    grid = E4M3_VALUES[:127]  # codes 0..126: the non-negative finite values, ascending
    a = x.double().abs().clamp(max=FP8_MAX)
    hi = torch.searchsorted(grid, a).clamp(max=126)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - grid[lo], grid[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (lo % 2 == 1))
    out = torch.where(pick_hi, grid[hi], grid[lo]) * torch.sign(x.double())
    return torch.where(x.isnan(), x.double(), out).float()


def _per_tensor_reference(x: torch.Tensor, scale: float):
    return _round_e4m3(x.float() * torch.tensor(scale, dtype=torch.float32)), _f32(1.0 / scale)


def _current_scale(amax: float) -> float:
    """recipe_common.cuh compute_scale_from_amax: fp8_max / amax in fp32; amax 0 -> 1."""
    return 1.0 if amax == 0.0 else _f32(FP8_MAX / amax)


def _block_reference(x: torch.Tensor) -> torch.Tensor:
    """Dequantized values of 1x128 blocks along rows, power-of-two scales (Float8BlockQuantizer's default)."""
    out = torch.empty_like(x, dtype=torch.float32)
    for c0 in range(0, x.shape[1], 128):
        block = x[:, c0:c0 + 128].float()
        for r in range(x.shape[0]):
            amax = float(block[r].abs().max())
            scale = 1.0 if amax == 0.0 else 2.0 ** (math.frexp(_f32(FP8_MAX / amax))[1] - 1)  # mantissa bits cut
            out[r, c0:c0 + 128] = _round_e4m3(block[r] * scale) * _f32(1.0 / scale)
    return out


def _mxfp8_reference(x: torch.Tensor):
    """(E4M3 values, e8m0 byte) per 1x32 block along rows: e = exponent of amax * fp32(1/448), rounded up."""
    rows, cols = x.shape
    values = torch.empty(rows, cols)
    codes = torch.empty(rows, cols // 32, dtype=torch.int64)
    rcp = _f32(1.0 / FP8_MAX)
    for r in range(rows):
        for b in range(cols // 32):
            block = x[r, b * 32:(b + 1) * 32].float()
            v = _f32(float(block.abs().max()) * rcp)
            m, ex = math.frexp(v)
            e = 0 if v == 0.0 else ex + 126 + (m != 0.5)
            codes[r, b] = e
            values[r, b * 32:(b + 1) * 32] = _round_e4m3(block * torch.tensor(2.0 ** (127 - e)))
    return values, codes


def _mx_dequantized(values, codes):
    return values * (2.0 ** (codes.double() - 127)).float().repeat_interleave(32, dim=1)


# -- with TE's Python loaded (one fresh rank per architecture) ---------------------------------------------------
def _quantizer(kind: str, **usage):
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer
    from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer, Float8Quantizer
    from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer

    from accel_fp8_fix.rehearsal.te_on_cpu import tex

    e4m3 = tex.DType.kFloat8E4M3
    if kind == "delayed":
        q = Float8Quantizer(torch.tensor([usage.pop("scale", 1.0)]), torch.zeros(1), e4m3)
    elif kind == "current":
        q = Float8CurrentScalingQuantizer(e4m3, torch.device("cpu"))
    elif kind in ("block1d", "block2d"):
        q = Float8BlockQuantizer(e4m3, rowwise=True, columnwise=True, block_scaling_dim=int(kind[5]))
    else:
        q = MXFP8Quantizer(e4m3)
    q.set_usage(rowwise=usage.get("rowwise", True), columnwise=usage.get("columnwise", True))
    return q


def _split_quantize_matches_reference(kind: str, splits) -> list:
    """tex.split_quantize against the per-split reference; one entry per split: all checks true."""
    from accel_fp8_fix.rehearsal.te_on_cpu import tex

    torch.manual_seed(5)
    x = (torch.randn(sum(splits), 256) * torch.logspace(-2, 2, 256)).to(torch.bfloat16)
    scales = [2.0, 0.5, 4.0, 1.0]
    quantizers = [_quantizer(kind, scale=s) for s in scales[:len(splits)]]  # scale: read by delayed scaling only
    outs = tex.split_quantize(x, splits, quantizers)
    report = []
    for i, (xi, out) in enumerate(zip(torch.split(x, splits), outs)):
        checks = {"shape": list(out.size()) == list(xi.shape)}
        if xi.shape[0] == 0:
            report.append(checks)
            continue
        if kind in ("delayed", "current"):
            amax = float(xi.float().abs().max())
            scale = scales[i] if kind == "delayed" else _current_scale(amax)
            values, scale_inv = _per_tensor_reference(xi, scale)
            checks["data"] = torch.equal(_decode(out._data), values)
            checks["transpose"] = torch.equal(out._transpose, out._data.t())
            checks["scale_inv"] = float(out._scale_inv) == scale_inv
            if kind == "delayed":  # the cast kernel max-accumulates the split's amax into its own quantizer
                checks["amax"] = float(quantizers[i].amax) == amax
        elif kind == "block1d":  # read back by TE's own Python dequantization of the blockwise layout
            checks["rowwise"] = torch.equal(out.dequantize(dtype=torch.float32), _block_reference(xi))
            out.update_usage(rowwise_usage=False, columnwise_usage=True)
            checks["columnwise"] = torch.equal(out.dequantize(dtype=torch.float32), _block_reference(xi.t()).t())
        else:
            m, k = xi.shape
            values, codes = _mxfp8_reference(xi)
            checks["rowwise"] = torch.equal(_decode(out._rowwise_data), values)
            checks["rowwise_scales"] = torch.equal(out._rowwise_scale_inv[:m, :k // 32].long(), codes)
            values_t, codes_t = _mxfp8_reference(xi.t())
            checks["columnwise"] = torch.equal(_decode(out._columnwise_data), values_t.t())
            checks["columnwise_scales"] = torch.equal(out._columnwise_scale_inv[:m // 32, :k].long(), codes_t.t())
        report.append(checks)
    return report


def _dequantized(kind: str, x: torch.Tensor, rowwise: bool) -> torch.Tensor:
    """The values a GEMM reads from ``x`` quantized by ``kind`` with one usage, from the references above (block
    scaling: TE's own Python dequantization)."""
    if kind == "off" or x.numel() == 0:
        return x.float()
    if kind == "current":
        values, scale_inv = _per_tensor_reference(x, _current_scale(float(x.float().abs().max())))
        return values * scale_inv
    if kind.startswith("block"):
        q = _quantizer(kind, rowwise=rowwise, columnwise=not rowwise)
        return q(x).dequantize(dtype=torch.float32)
    if rowwise:
        return _mx_dequantized(*_mxfp8_reference(x))
    return _mx_dequantized(*_mxfp8_reference(x.t())).t()


def _close_to_fp64(got, b, a, bias=None) -> bool:
    """got == b @ a (+ bias) within fp32 accumulation: |err| <= (K + 2) 2**-23 (|b| @ |a| + |bias|)."""
    ref = b.double() @ a.double()
    bound = b.double().abs() @ a.double().abs()
    if bias is not None:
        ref, bound = ref + bias.double(), bound + bias.double().abs()
    return bool(((got.double() - ref).abs() <= (a.shape[0] + 2) * 2.0 ** -23 * bound).all())


def _operands(weight_kind: str, act_kind: str, splits, e=4, out_features=64, in_features=128):
    torch.manual_seed(7)
    w = [(torch.randn(out_features, in_features) / 8).to(torch.bfloat16) for _ in range(e)]
    x = torch.randn(sum(splits), in_features).to(torch.bfloat16)
    dy = torch.randn(sum(splits), out_features).to(torch.bfloat16)
    bias = [torch.randn(out_features).to(torch.bfloat16) for _ in range(e)]
    if act_kind == "off":
        return w, list(torch.split(x, splits)), list(torch.split(dy, splits)), (w, x, dy, bias)
    wq = [_quantizer(weight_kind)(t) for t in w]
    xq = [_quantizer(act_kind)(t) for t in torch.split(x, splits)]
    dyq = [_quantizer(act_kind)(t) for t in torch.split(dy, splits)]
    return wq, xq, dyq, (w, x, dy, bias)


def _grouped_gemm_checks(weight_kind: str, act_kind: str, splits) -> dict:
    """TE's general_grouped_gemm for fprop (TN), dgrad (NN) and wgrad (NT, fresh and accumulating) against
    general_gemm per group (bit for bit) and the fp64 product of the dequantized operands."""
    from transformer_engine.pytorch.cpp_extensions.gemm import general_gemm, general_grouped_gemm

    wq, xq, dyq, (w, x, dy, bias) = _operands(weight_kind, act_kind, splits)
    e, f32 = len(w), torch.float32
    xs, dys, rows = torch.split(x, splits), torch.split(dy, splits), torch.split(torch.arange(sum(splits)), splits)
    deq = {f"{name}_{usage}": [_dequantized(kind, t, usage == "row") for t in tensors]
           for name, kind, tensors in (("w", weight_kind, w), ("x", act_kind, xs), ("dy", act_kind, dys))
           for usage in ("row", "col")}
    checks = {}
    y = torch.full((sum(splits), w[0].shape[0]), float("nan"))
    general_grouped_gemm(wq, xq, [y], [None] * e, f32, layout="TN", m_splits=splits, single_output=True,
                         bias=bias, use_bias=True)
    dx = torch.full((sum(splits), w[0].shape[1]), float("nan"))
    general_grouped_gemm(wq, dyq, [dx], [None] * e, f32, layout="NN", m_splits=splits, single_output=True, grad=True)
    dw = [torch.full_like(t, float("nan"), dtype=f32) for t in w]
    _, dbias, _ = general_grouped_gemm(xq, dyq, dw, [None] * e, f32, layout="NT", m_splits=splits, grad=True,
                                       use_bias=act_kind == "off", bias=bias)
    dw_acc = [torch.ones_like(t, dtype=f32) for t in w]
    general_grouped_gemm(xq, dyq, dw_acc, [None] * e, f32, layout="NT", m_splits=splits, grad=True, accumulate=True)
    for i in range(e):
        if splits[i] == 0:
            checks[f"empty{i}"] = bool((dw[i] == 0).all()) and bool((dw_acc[i] == 1).all()) and (
                act_kind != "off" or bool((dbias[i] == 0).all()))
            continue
        r = rows[i]
        single_y = general_gemm(wq[i], xq[i], out_dtype=f32, layout="TN", bias=bias[i])[0]
        single_dx = general_gemm(wq[i], dyq[i], out_dtype=f32, layout="NN", grad=True)[0]
        single_dw = general_gemm(xq[i], dyq[i], out_dtype=f32, layout="NT", grad=True)[0]
        checks[f"fprop{i}_single"] = torch.equal(y[r], single_y)
        checks[f"dgrad{i}_single"] = torch.equal(dx[r], single_dx)
        checks[f"wgrad{i}_single"] = torch.equal(dw[i], single_dw)
        checks[f"wgrad{i}_accumulate"] = torch.equal(dw_acc[i], single_dw + 1)  # D + 1 * D_old in fp32, as the epilogue
        checks[f"fprop{i}_fp64"] = _close_to_fp64(y[r], deq["x_row"][i], deq["w_row"][i].t(), bias[i])
        checks[f"dgrad{i}_fp64"] = _close_to_fp64(dx[r], deq["dy_row"][i], deq["w_col"][i])
        checks[f"wgrad{i}_fp64"] = _close_to_fp64(dw[i], deq["dy_col"][i].t(), deq["x_col"][i])
        if act_kind == "off":
            checks[f"dbias{i}"] = torch.allclose(dbias[i], dys[i].float().sum(0), rtol=1e-5, atol=1e-5)
    return checks


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _grouped_vs_linears(recipe_name, splits, in_features=128, out_features=64) -> dict:
    """te.GroupedLinear forward + backward against E te.Linear modules with the same weights (one autocast each,
    fresh state: a first step) and against fp32; the upstream gradient is fixed."""
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe as recipes

    recipe = None if recipe_name == "off" else getattr(recipes, recipe_name)()
    e, bf16 = len(splits), torch.bfloat16
    torch.manual_seed(11)
    grouped = te.GroupedLinear(e, in_features, out_features, bias=True, params_dtype=bf16)
    linears = [te.Linear(in_features, out_features, bias=True, params_dtype=bf16) for _ in range(e)]
    with torch.no_grad():
        for i, lin in enumerate(linears):
            grouped.get_parameter(f"bias{i}").normal_()
            lin.weight.copy_(grouped.get_parameter(f"weight{i}"))
            lin.bias.copy_(grouped.get_parameter(f"bias{i}"))
    x = torch.randn(sum(splits), in_features, dtype=bf16, requires_grad=True)
    dy = torch.randn(sum(splits), out_features, dtype=bf16)
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        y = grouped(x, splits)
    y.backward(dy)
    ys, dxs, ref_y, ref_dx, out = [], [], [], [], {"exact": {}, "rel": {}}
    for i, (lin, xi, dyi) in enumerate(zip(linears, x.detach().split(splits), dy.split(splits))):
        wg, bg = grouped.get_parameter(f"weight{i}"), grouped.get_parameter(f"bias{i}")
        if splits[i] == 0:  # no tokens: zero gradients, from the grouped GEMM's empty-group rule
            out["exact"][f"empty{i}"] = bool((wg.grad == 0).all()) and bool((bg.grad == 0).all())
            continue
        xi = xi.clone().requires_grad_(True)
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            yi = lin(xi)
        yi.backward(dyi)
        ys.append(yi.detach())
        dxs.append(xi.grad)
        out["exact"][f"dw{i}"] = torch.equal(wg.grad, lin.weight.grad)
        out["exact"][f"db{i}"] = torch.equal(bg.grad, lin.bias.grad)
        xr, wr = xi.detach().float().requires_grad_(True), wg.detach().float().requires_grad_(True)
        yr = torch.nn.functional.linear(xr, wr, bg.detach().float())
        yr.backward(dyi.float())
        ref_y.append(yr.detach())
        ref_dx.append(xr.grad)
        out["rel"][f"dw{i}"] = _rel(wg.grad, wr.grad)
        out["rel"][f"db{i}"] = _rel(bg.grad, dyi.float().sum(0))
    out["exact"]["y"] = torch.equal(y.detach(), torch.cat(ys))
    out["exact"]["dx"] = torch.equal(x.grad, torch.cat(dxs))
    out["rel"]["y"] = _rel(y.detach(), torch.cat(ref_y))
    out["rel"]["dx"] = _rel(x.grad, torch.cat(ref_dx))
    return out


def _padding_checks() -> dict:
    """fused_multi_row_padding / _unpadding (padding.cu) against torch, then Fp8Padding -> GroupedLinear ->
    Fp8Unpadding under Float8CurrentScaling on splits that are not multiples of 16."""
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import Float8CurrentScaling

    from accel_fp8_fix.rehearsal.te_on_cpu import tex

    torch.manual_seed(13)
    splits, padded = [20, 0, 37, 5], [32, 0, 48, 16]
    x = torch.randn(sum(splits), 64, dtype=torch.bfloat16)
    want = torch.cat([torch.cat([xi, torch.zeros(p - m, 64, dtype=x.dtype)]) for xi, m, p in
                      zip(x.split(splits), splits, padded)])
    out = torch.full((sum(padded), 64), float("nan"), dtype=x.dtype)
    tex.fused_multi_row_padding(x, out, splits, padded)
    back = torch.full_like(x, float("nan"))
    tex.fused_multi_row_unpadding(out, back, padded, splits)
    checks = {"pad": torch.equal(out, want), "unpad": torch.equal(back, x)}
    grouped = te.GroupedLinear(4, 64, 32, bias=True, params_dtype=torch.bfloat16)
    pad, unpad = te.Fp8Padding(4), te.Fp8Unpadding(4)
    xg = x.clone().requires_grad_(True)
    with te.autocast(enabled=True, recipe=Float8CurrentScaling()):
        xp, padded_splits = pad(xg, splits)
        y = unpad(grouped(xp, padded_splits), splits)
    dy = torch.randn_like(y)
    y.backward(dy)
    xr = x.float().requires_grad_(True)
    yr = torch.cat([torch.nn.functional.linear(xi, grouped.get_parameter(f"weight{i}").detach().float(),
                                               grouped.get_parameter(f"bias{i}").detach().float())
                    for i, xi in enumerate(xr.split(splits))])
    yr.backward(dy.float())
    checks.update(padded_splits=padded_splits == padded, shape=list(y.shape) == [sum(splits), 32])
    return checks | {"rel_y": _rel(y.detach(), yr.detach()), "rel_dx": _rel(xg.grad, xr.grad)}


def _not_implemented_messages() -> dict:
    """Ops GroupedLinear's other paths reach that the shim does not implement: each raises, naming the op."""
    from accel_fp8_fix.rehearsal.te_on_cpu import tex

    messages = {}
    for name in ("te_general_grouped_gemm_for_discrete_in", "group_quantize", "bgrad_group_quantize"):
        try:
            getattr(tex, name)(torch.zeros(4, 4), None, 1, None)
            messages[name] = None
        except NotImplementedError as exc:
            messages[name] = str(exc)
    return messages


def _stats_of_one_step(recipe_name, splits) -> dict:
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe as recipes

    from accel_fp8_fix.rehearsal import te_on_cpu

    recipe = None if recipe_name == "off" else getattr(recipes, recipe_name)()
    grouped = te.GroupedLinear(len(splits), 128, 64, bias=True, params_dtype=torch.bfloat16)
    x = torch.randn(sum(splits), 128, dtype=torch.bfloat16, requires_grad=True)
    te_on_cpu.reset_stats()
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        y = grouped(x, splits)
    y.backward(torch.randn_like(y))
    return {k: v for k, v in te_on_cpu.stats().items() if "gemms" in k or k.startswith("split")}


def _unpadded_grouped_linear(recipe_name, splits=(5, 11, 16)) -> dict:
    """GroupedLinear(3, 128, 256) forward + backward on splits that are not multiples of 16, without Fp8Padding:
    {"forward": message or None, "backward": message or None}."""
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe as recipes

    torch.manual_seed(17)
    grouped = te.GroupedLinear(3, 128, 256, bias=True, params_dtype=torch.bfloat16)
    x = torch.randn(sum(splits), 128, dtype=torch.bfloat16, requires_grad=True)
    out = {"forward": None, "backward": None}
    try:
        with te.autocast(enabled=True, recipe=getattr(recipes, recipe_name)()):
            y = grouped(x, list(splits))
    except RuntimeError as exc:
        out["forward"] = str(exc)
        return out
    try:
        y.backward(torch.randn_like(y))
    except RuntimeError as exc:
        out["backward"] = str(exc)
    return out


def _blackwell_refusals() -> dict:
    """sm100: FP8 block scaling emulated with MXFP8 needs every operand block-scaled (gemm.cpp:592-594, grouped;
    swizzle.cpp:307-308, single GEMM); the FP8 leading dimensions follow Blackwell's any-layout FP8 GEMM
    (cublaslt_gemm.cu:135 and :226: lda = m for a non-transposed A, ldb = n for a transposed B)."""
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer
    from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer

    from accel_fp8_fix.rehearsal.te_on_cpu import tex

    e4m3, f32 = tex.DType.kFloat8E4M3, tex.DType.kFloat32
    torch.manual_seed(19)

    def block(x):
        return tex.quantize(x, Float8BlockQuantizer(e4m3, rowwise=True, columnwise=True, block_scaling_dim=1))

    def current(x):
        return tex.quantize(x, Float8CurrentScalingQuantizer(e4m3, torch.device("cpu")))

    def gemm(a, transa, b, transb):
        return tex.generic_gemm(a, transa, b, transb, None, None, f32, None, f32, False, None, False, None, 0,
                                False, False)

    w, x = [torch.randn(64, 128) for _ in range(2)], [torch.randn(32, 128) for _ in range(2)]
    empty = [torch.empty(0)] * 2
    return {
        "single_block_x_current": scenarios.runtime_error_of(lambda: gemm(block(w[0]), True, current(x[0]), False)),
        "grouped_block_x_current": scenarios.runtime_error_of(lambda: tex.te_general_grouped_gemm(
            [block(t) for t in w], True, [block(x[0]), current(x[1])], False, None, f32, [32, 32], empty, f32,
            False, empty, False, empty, 0, False, False, 0)),
        "lda_m24": scenarios.runtime_error_of(lambda: gemm(current(torch.randn(32, 24)), False, current(torch.randn(16, 32)), False)),
        "ldb_n24": scenarios.runtime_error_of(lambda: gemm(current(torch.randn(32, 48)), False, current(torch.randn(32, 24)), True)),
        "tn_k32": scenarios.runtime_error_of(lambda: gemm(current(torch.randn(24, 32)), True, current(torch.randn(40, 32)), False)),
    }


def _on_hopper(rank, world_size):
    from accel_fp8_fix.rehearsal import te_on_cpu

    te_on_cpu.install()
    import transformer_engine.pytorch  # noqa: F401  (TE's Python over the shim)

    recipes = ("off", "DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling")
    kinds = ("delayed", "current", "block1d")
    return {"split": {kind: _split_quantize_matches_reference(kind, SPLITS) for kind in kinds},
            "gemm": {f"{w}-{a}": _grouped_gemm_checks(w, a, SPLITS) for w, a in
                     (("off", "off"), ("current", "current"), ("block2d", "block1d"), ("block1d", "block1d"))},
            "e2e": {name: _grouped_vs_linears(name, SPLITS) for name in recipes},
            "stats": {name: _stats_of_one_step(name, SPLITS) for name in recipes},
            "padding": _padding_checks(), "not_implemented": _not_implemented_messages(),
            "unpadded": {name: _unpadded_grouped_linear(name) for name in ("DelayedScaling", "Float8CurrentScaling")}}


def _on_blackwell(rank, world_size):
    from accel_fp8_fix.rehearsal import te_on_cpu

    te_on_cpu.install()
    from transformer_engine.pytorch.tensor.nvfp4_tensor import NVFP4Quantizer

    from accel_fp8_fix.rehearsal.te_on_cpu import tex

    try:
        tex.split_quantize(torch.randn(64, 128), [32, 32], [NVFP4Quantizer(), NVFP4Quantizer()])
        nvfp4 = None
    except NotImplementedError as exc:
        nvfp4 = str(exc)
    return {"split": _split_quantize_matches_reference("mxfp8", SPLITS_MX),
            "gemm": _grouped_gemm_checks("mxfp8", "mxfp8", SPLITS_MX),
            "e2e": {name: _grouped_vs_linears(name, SPLITS_MX) for name in ("MXFP8BlockScaling", "off")},
            "stats": _stats_of_one_step("MXFP8BlockScaling", SPLITS_MX), "nvfp4_split": nvfp4,
            "refusals": _blackwell_refusals()}


@pytest.fixture(scope="module")
def hopper():
    (result,) = launcher.run(_on_hopper, 1, env={"ACCEL_FP8_FIX_CPU_TE_ARCH": "sm90"}, timeout=600)
    return result


@pytest.fixture(scope="module")
def blackwell():
    (result,) = launcher.run(_on_blackwell, 1, env={"ACCEL_FP8_FIX_CPU_TE_ARCH": "sm100"}, timeout=600)
    return result


# -- in this process: the shim alone ------------------------------------------------------------------------------
def test_splits_to_offsets_is_the_scaled_prefix_sum():
    from accel_fp8_fix.rehearsal.te_on_cpu import tex

    got = tex.splits_to_offsets(torch.tensor([3, 0, 5, 2]), 16)
    assert got.dtype == torch.int64 and got.tolist() == [0, 48, 48, 128, 160]
    with pytest.raises(RuntimeError, match="int64"):
        tex.splits_to_offsets(torch.tensor([3, 0], dtype=torch.int32), 16)


def test_grouped_gemm_single_output_needs_its_output_as_tes_extension():
    from accel_fp8_fix.rehearsal.te_on_cpu import tex

    a, b = [torch.randn(8, 16)], [torch.randn(4, 16)]
    with pytest.raises(RuntimeError, match="D should be allocated for single output"):
        tex.te_general_grouped_gemm(a, True, b, False, None, tex.DType.kFloat32, [4], [torch.empty(0)],
                                    tex.DType.kFloat32, True, [torch.empty(0)], False, [torch.empty(0)], 0,
                                    False, False, 0)


def test_grouped_gemm_packs_outputs_and_zeroes_empty_groups():
    """single_output: group i's [m_i, n] block follows group i-1's in D[0]; an empty group writes nothing there,
    and with separate outputs it zeroes its D (not when accumulating) and its grad-bias."""
    from accel_fp8_fix.rehearsal.te_on_cpu import tex

    def mm(a, b):  # all fp32: TE's GEMMs in TF32 on the device (tex.round_to_tf32)
        return tex.round_to_tf32(a, tex.tf32_mode()) @ tex.round_to_tf32(b, tex.tf32_mode())

    torch.manual_seed(1)
    w = [torch.randn(8, 16) for _ in range(3)]
    x = [torch.randn(m, 16) for m in (4, 0, 6)]
    d = torch.full((10, 8), float("nan"))
    empty = [torch.empty(0)] * 3
    tex.te_general_grouped_gemm(w, True, x, False, [d], tex.DType.kFloat32, [4, 0, 6], empty, tex.DType.kFloat32,
                                True, empty, False, empty, 0, False, False, 0)
    assert torch.equal(d, torch.cat([mm(x[0], w[0].t()), mm(x[2], w[2].t())]))
    outs, dbias = [torch.full((8, 16), 5.0) for _ in range(3)], [torch.full((8,), 5.0) for _ in range(3)]
    dys = [torch.randn(m, 8) for m in (4, 0, 6)]
    tex.te_general_grouped_gemm(x, False, dys, True, outs, tex.DType.kFloat32, [4, 0, 6], dbias,
                                tex.DType.kFloat32, False, empty, True, empty, 0, False, False, 0)
    assert torch.equal(outs[1], torch.zeros(8, 16)) and torch.equal(dbias[1], torch.zeros(8))
    assert torch.equal(outs[0], mm(dys[0].t(), x[0])) and torch.equal(dbias[2], dys[2].sum(0))
    acc = [torch.full((8, 16), 5.0) for _ in range(3)]
    tex.te_general_grouped_gemm(x, False, dys, True, acc, tex.DType.kFloat32, [4, 0, 6], empty,
                                tex.DType.kFloat32, False, empty, True, empty, 0, True, False, 0)
    assert torch.equal(acc[1], torch.full((8, 16), 5.0)) and torch.equal(acc[2], mm(dys[2].t(), x[2]) + 5.0)


# -- TE's Python over the shim -------------------------------------------------------------------------------------
def test_split_quantize_matches_the_per_split_reference(hopper, blackwell):
    results = {**hopper["split"], "mxfp8": blackwell["split"]}
    for kind, report in results.items():
        assert len(report) == 4 and set(report[1]) == {"shape"}, (kind, report)  # the empty split: allocated only
        for checks in report:
            assert all(checks.values()), (kind, report)


@pytest.mark.parametrize("case", ["off-off", "current-current", "block2d-block1d", "block1d-block1d", "mxfp8-mxfp8"])
def test_grouped_gemm_equals_single_gemms_and_the_fp64_product(hopper, blackwell, case):
    checks = blackwell["gemm"] if case == "mxfp8-mxfp8" else hopper["gemm"][case]
    assert len(checks) >= 22 and "empty1" in checks
    assert all(checks.values()), {k: v for k, v in checks.items() if not v}


# Relative errors against fp32 (E4M3 activations and weights; E5M2 gradients under delayed / current scaling).
BOUNDS = {"off": (0.0, 0.005, 0.005), "DelayedScaling": (0.005, 0.02, 0.08),
          "Float8CurrentScaling": (0.005, 0.02, 0.08), "Float8BlockScaling": (0.005, 0.02, 0.05),
          "MXFP8BlockScaling": (0.005, 0.02, 0.05)}


@pytest.mark.parametrize("recipe", ["off", "DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling",
                                    "MXFP8BlockScaling", "off-sm100"])
def test_grouped_linear_equals_one_linear_per_expert_bit_for_bit(hopper, blackwell, recipe):
    """Exact for every recipe: each expert's split is quantized as te.Linear quantizes its input (its own
    quantizer: current / block / MXFP8 scales from the split alone) and each group's GEMM is te.Linear's GEMM.
    Delayed scaling too, on this first step: every scale is still 1 in both (a later step would follow each
    module's own amax history, equal only while their histories are)."""
    result = blackwell["e2e"]["off" if recipe == "off-sm100" else recipe] if recipe in (
        "MXFP8BlockScaling", "off-sm100") else hopper["e2e"][recipe]
    assert result["exact"] and all(result["exact"].values()), result["exact"]
    low, y_bound, grad_bound = BOUNDS[recipe.replace("-sm100", "")]
    rel = result["rel"]
    assert low <= rel["y"] < y_bound and rel["dx"] < grad_bound, rel
    assert all(low <= v < grad_bound for k, v in rel.items() if k.startswith("dw")), rel
    assert all(v < 0.005 for k, v in rel.items() if k.startswith("db")), rel  # bias grads: bf16 sums of dy


@pytest.mark.parametrize("recipe", ["off", "DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling",
                                    "MXFP8BlockScaling"])
def test_grouped_linear_runs_one_gemm_per_non_empty_group(hopper, blackwell, recipe):
    stats = blackwell["stats"] if recipe == "MXFP8BlockScaling" else hopper["stats"][recipe]
    kind = "non_fp8_gemms" if recipe == "off" else "fp8_gemms"
    assert (stats["grouped_gemms"], stats[kind + "_fwd"], stats[kind + "_bwd"]) == (3, 3, 6), stats  # 3 of 4 experts
    assert stats["fp8_gemms" if recipe == "off" else "non_fp8_gemms"] == 0, stats
    assert stats.get("split_quantize", 0) == (0 if recipe == "off" else 1 + (recipe == "Float8BlockScaling")), stats


def test_fp8_padding_and_unpadding_around_grouped_linear(hopper):
    result = hopper["padding"]
    assert all(v for k, v in result.items() if not k.startswith("rel")), result
    assert 0.005 < result["rel_y"] < 0.06 and result["rel_dx"] < 0.08, result  # E4M3 x E4M3, zero bias


def test_ops_the_shim_does_not_implement_still_raise(hopper, blackwell):
    for name, message in hopper["not_implemented"].items():
        assert message and message.startswith(f"transformer_engine_torch.{name}: not implemented by the CPU rehearsal")
    assert blackwell["nvfp4_split"] and "split_quantize with NVFP4" in blackwell["nvfp4_split"]


def test_unpadded_experts_trip_cublaslts_fp8_leading_dimension_rule_on_hopper(hopper):
    """cublaslt_gemm.cu:159-163 per GEMM of the grouped GEMM (nvte_multi_tensor_gemm -> cublas_gemm): on sm90 the
    wgrad's lda is the expert's token count, so m_splits [5, 11, 16] under per-tensor FP8 are refused in the
    backward (the forward's lda and ldb are in_features); Fp8Padding (or the package's MoE path) pads them."""
    for name, got in hopper["unpadded"].items():
        assert got["forward"] is None, (name, got)
        assert got["backward"] == "Leading dimension requirement on A for FP8 GEMM. Caller must pad.", (name, got)


def test_blackwell_block_scaling_emulation_and_fp8_leading_dimensions(blackwell):
    got = blackwell["refusals"]
    assert got["single_block_x_current"] == "Input tensor must be a block scaling tensor"
    assert got["grouped_block_x_current"] == "Either all tensors or no tensor must be FP8 block scaling tensors"
    assert got["lda_m24"] == "Leading dimension requirement on A for FP8 GEMM. Caller must pad."
    assert got["ldb_n24"] == "Leading dimension requirement on B for FP8 GEMM. Caller must pad."
    assert got["tn_k32"] is None
