"""FP8 block scaling and NVFP4 in the CPU kernel shim (accel_fp8_fix.rehearsal.te_on_cpu.tex), issue 12 item 5.

Kernels against references: block scaling against a per-block reference written here from TE's kernels
(``quantize_transpose_{vector,square}_blockwise.cu``, ``recipe_common.cuh``) and against TE's own Python
dequantization of its ``Float8BlockwiseQTensor`` layout; NVFP4 bit for bit against TE's own pure-Python
reference quantizer (``transformer_engine.pytorch.custom_recipes.reference_nvfp4``, shipped in the wheel).
Then ``te.Linear`` forward + backward under ``Float8BlockScaling()`` (Hopper) and ``NVFP4BlockScaling()``
(Blackwell, ``ACCEL_FP8_FIX_CPU_TE_ARCH=sm100``) against an fp32 reference, and TE's own refusals where the
GPU generation cannot run a recipe. Each architecture runs in its own fresh process (TE caches its answers).
"""

from __future__ import annotations

import math
import struct

import pytest
import torch

from accel_fp8_fix.rehearsal.te_on_cpu import tex
from support import launcher

E4M3, E5M2 = tex.DType.kFloat8E4M3, tex.DType.kFloat8E5M2
FLT_MAX = torch.finfo(torch.float32).max


def _f32(value: float) -> float:
    return struct.unpack("<f", struct.pack("<f", value))[0]


# -- block scaling: a per-block reference from the kernel source (Python floats, not the shim's code) ----------
def _reference_scale(amax: float, fp8_max: float, pow2: bool, eps: float, value_for_inf: float) -> float:
    """compute_scale_from_amax on Python floats rounded to fp32 (a correctly rounded quotient)."""
    if amax < eps:
        amax = eps
    if math.isinf(amax) or amax == 0.0 or math.isnan(amax):
        return 1.0
    scale = fp8_max / amax
    scale = _f32(scale) if scale <= FLT_MAX * (1 + 2 ** -25) else math.inf
    if math.isinf(scale):
        scale = value_for_inf
    if pow2:
        bits = struct.unpack("<I", struct.pack("<f", scale))[0] & 0xFF800000
        scale = struct.unpack("<f", struct.pack("<I", bits))[0]
    return scale


def _reference_blocks(x: torch.Tensor, dim: int, pow2: bool, fmt=E4M3):
    """{(r, c): (scale_inv, [fp8 value, ...])} per 1x128 block (dim 1, along rows) or 128x128 tile (dim 2)."""
    fp8_max = {E4M3: 448.0, E5M2: 57344.0}[fmt]
    rows, cols = x.shape
    out = {}
    heights = 128 if dim == 2 else 1
    for r0 in range(0, rows, heights):
        for c0 in range(0, cols, 128):
            block = x[r0:r0 + heights, c0:c0 + 128]
            amax = max((abs(v) for v in block.flatten().tolist() if not math.isnan(v)), default=0.0)
            scale = _reference_scale(amax, fp8_max, pow2, 0.0, FLT_MAX)
            # the elementwise cast (cvt.rn.satfinite) is checked against the FP8 bit layouts in test_te_on_cpu.py
            values = tex.fp8_bits_to_float(tex.cast_to_fp8(block, torch.tensor([scale]), fmt), fmt)
            out[(r0 // heights, c0 // 128)] = (_f32(1.0 / scale), values)
    return out


@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("dim", [1, 2])
def test_block_quantize_matches_the_per_block_reference_and_tes_layout(dim, pow2):
    torch.manual_seed(0)
    x = torch.randn(136, 260) * torch.logspace(-3, 3, 260)  # partial blocks on both dims, wide dynamic range
    x[5, 7] = float("nan")  # ignored by the amax (fmaxf), stays NaN
    parts = tex.fp8_block_quantize_2d(x, E4M3, dim, rowwise=True, columnwise=True, force_pow_2=pow2)
    ref = _reference_blocks(x, dim, pow2)
    rowwise = tex.fp8_bits_to_float(parts["rowwise_data"], E4M3)
    columnwise = tex.fp8_bits_to_float(parts["columnwise_data"], E4M3)
    assert parts["columnwise_data"].shape == (260, 136)
    for (rb, cb), (scale_inv, values) in ref.items():
        r0, c0 = rb * (128 if dim == 2 else 1), cb * 128
        got = rowwise[r0:r0 + values.shape[0], c0:c0 + 128]
        assert torch.equal(got.isnan(), values.isnan()) and torch.equal(got.nan_to_num(), values.nan_to_num())
        if dim == 2:  # [m_tile, k_tile] row-wise, [k_tile, m_tile] column-wise; column-wise data = transpose
            assert float(parts["rowwise_scale_inv"][rb, cb]) == scale_inv
            assert float(parts["columnwise_scale_inv"][cb, rb]) == scale_inv
        else:  # GEMM_READY: [k_block, m]
            assert float(parts["rowwise_scale_inv"][cb, rb]) == scale_inv
    if dim == 2:
        assert torch.equal(parts["columnwise_data"], parts["rowwise_data"].t())
        assert parts["rowwise_scale_inv"].shape == (2, 4) and parts["columnwise_scale_inv"].shape == (3, 4)
    else:  # 1-D column-wise = 128 x 1 blocks down each column = 1x128 blocks of the transpose, at [m_block, k]
        for (kb, mb), (scale_inv, values) in _reference_blocks(x.t().contiguous(), 1, pow2).items():
            assert float(parts["columnwise_scale_inv"][mb, kb]) == scale_inv
            got = columnwise[kb, mb * 128:mb * 128 + 128]
            assert torch.equal(got.isnan(), values[0].isnan()) and torch.equal(got.nan_to_num(), values[0].nan_to_num())
        assert parts["rowwise_scale_inv"].shape == (3, 136) and parts["columnwise_scale_inv"].shape == (2, 260)


def test_block_scale_edge_cases():
    amax = torch.tensor([0.0, float("inf"), 3.0, 1e-40, 448.0])
    got = tex.block_scale_from_amax(amax, 448.0, False, 0.0, FLT_MAX).tolist()
    assert got == [_reference_scale(float(a), 448.0, False, 0.0, FLT_MAX) for a in amax.tolist()]
    assert got[:2] == [1.0, 1.0] and got[3] == FLT_MAX  # amax 0 / inf -> 1; an infinite quotient -> the type's max
    pow2 = tex.block_scale_from_amax(amax, 448.0, True, 0.0, 65504.0).tolist()  # fp16 input: value_for_inf 65504
    assert pow2 == [1.0, 1.0, 128.0, 32768.0, 1.0]
    assert tex.block_scale_from_amax(torch.tensor([1e-3]), 448.0, False, 1.0, FLT_MAX).tolist() == [448.0]  # epsilon


# -- NVFP4 elementwise ------------------------------------------------------------------------------------------
def test_e2m1_rounds_to_nearest_even_and_saturates():
    grid = list(tex.E2M1_GRID)
    ties = [(a + b) / 2 for a, b in zip(grid, grid[1:])]
    want_ties = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]  # 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4
    near = [b - (b - a) / 8 for a, b in zip(grid, grid[1:])]
    xs = torch.tensor(ties + near + [7.0, 100.0, float("inf")])
    values = tex._E2M1_VALUES[tex.e2m1_codes(xs).long()].tolist()
    assert values == want_ties + grid[1:] + [6.0, 6.0, 6.0]
    assert tex.e2m1_codes(-xs).tolist() == [c | 8 for c in tex.e2m1_codes(xs).tolist()]
    packed = tex.pack_fp4(torch.tensor([[1, 2, 15, 7]], dtype=torch.uint8))
    assert packed.tolist() == [[0x21, 0x7F]]  # even element in the low nibble
    assert torch.equal(tex.unpack_fp4(packed), torch.tensor([[1, 2, 15, 7]], dtype=torch.uint8))


def test_e2m1_stochastic_rounding_picks_a_neighbour_and_is_unbiased():
    gen = torch.Generator().manual_seed(0)
    x = torch.full((20000,), 2.4)  # between 2 and 3: rounds up with probability 0.4
    values = tex._E2M1_VALUES[tex.e2m1_codes_stochastic(x, gen).long()]
    assert set(values.unique().tolist()) == {2.0, 3.0}
    assert abs(float(values.mean()) - 2.4) < 0.02
    exact = torch.tensor(list(tex.E2M1_GRID) + [9.0])  # grid values stay; beyond 6 saturates
    assert tex._E2M1_VALUES[tex.e2m1_codes_stochastic(exact, gen).long()].tolist() == list(tex.E2M1_GRID) + [6.0]


def test_nvfp4_global_scale_edge_cases():
    amax = torch.tensor([2688.0, 0.0, float("inf"), 1e-45])
    assert tex.nvfp4_global_encode_scale(amax).tolist() == [1.0, 1.0, 1.0, FLT_MAX]


def test_nvfp4_data_transpose_repacks_nibbles_and_swap_first_dims():
    codes = torch.randint(0, 16, (6, 8), dtype=torch.uint8)
    out = torch.empty(8, 3, dtype=torch.uint8)
    tex.nvfp4_data_transpose(tex.pack_fp4(codes), out=out)
    assert torch.equal(tex.unpack_fp4(out), codes.t())
    gathered = torch.arange(24).reshape(2, 3, 4)  # [world, rows, cols] as TE's all-gathers interleave them
    target = torch.empty(3, 2, 4, dtype=gathered.dtype)
    tex.swap_first_dims(gathered, out=target.view(3, 2, 4))
    assert torch.equal(target, gathered.transpose(0, 1)) and torch.equal(tex.swap_first_dims(gathered), target)

# -- with TE's Python loaded: one fresh rank per architecture ----------------------------------------------------
def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _linear_under(recipe, dtype, in_features=256, out_features=128, tokens=256):
    """te.Linear forward + backward under ``recipe`` against the fp32 reference on the same weights; the upstream
    gradient is fixed, so every error is the GEMMs' quantization."""
    import transformer_engine.pytorch as te

    from accel_fp8_fix.rehearsal import te_on_cpu

    torch.manual_seed(0)
    linear = te.Linear(in_features, out_features, params_dtype=dtype)
    x = torch.randn(tokens, in_features, dtype=dtype, requires_grad=True)
    grad = torch.randn(tokens, out_features, dtype=dtype)
    te_on_cpu.reset_stats()
    with te.autocast(enabled=True, recipe=recipe):
        y = linear(x)
    y.backward(grad)
    stats = te_on_cpu.stats()
    xr = x.detach().float().requires_grad_(True)
    wr = linear.weight.detach().float().requires_grad_(True)
    yr = torch.nn.functional.linear(xr, wr, linear.bias.detach().float())
    yr.backward(grad.float())
    return {"y": _rel(y.detach(), yr.detach()), "dx": _rel(x.grad, xr.grad), "dw": _rel(linear.weight.grad, wr.grad),
            "stats": {k: v for k, v in stats.items() if k != "amax_reduction_groups"}}


def _layernorm_mlp_under(recipe, dtype):
    """te.LayerNormMLP (norm output quantized by the norm, GELU output by the activation) against fp32."""
    import transformer_engine.pytorch as te

    from accel_fp8_fix.rehearsal import te_on_cpu

    torch.manual_seed(3)
    mlp = te.LayerNormMLP(128, 256, params_dtype=dtype)
    x = torch.randn(2, 64, 128, dtype=dtype)
    te_on_cpu.reset_stats()
    with te.autocast(enabled=True, recipe=recipe):
        y = mlp(x)
    y.backward(torch.randn_like(y))
    stats = te_on_cpu.stats()
    f = {name: p.detach().float() for name, p in mlp.named_parameters()}
    h = torch.nn.functional.layer_norm(x.float(), (128,), f["layer_norm_weight"], f["layer_norm_bias"], eps=mlp.eps)
    h = torch.nn.functional.gelu(torch.nn.functional.linear(h, f["fc1_weight"], f["fc1_bias"]), approximate="tanh")
    reference = torch.nn.functional.linear(h, f["fc2_weight"], f["fc2_bias"])
    return {"fwd": stats["fp8_gemms_fwd"], "bwd": stats["fp8_gemms_bwd"], "hp": stats["non_fp8_gemms"],
            "rel_err": _rel(y.detach(), reference)}


def _te_refusals() -> dict:
    """What TE's C++ refuses or returns early on (issue 28 item 2), through the shim; each value is what happened."""
    import torch.distributed as dist
    from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer, Float8Quantizer

    from accel_fp8_fix.rehearsal import te_on_cpu

    def outcome(call):
        try:
            result = call()
        except RuntimeError as exc:
            return "refused: " + str(exc)
        return f"returned {type(result).__name__}"

    a, b = torch.randn(16, 32), torch.randn(8, 32)  # TN: D = b @ a.T, [8, 16]

    def gemm(D=None, accumulate=False, beta=None, out_dtype=tex.DType.kFloat32):
        return tex.generic_gemm(a, True, b, False, D, None, out_dtype, None, tex.DType.kFloat32, False, None, False,
                                torch.empty(0), 0, accumulate, False, beta=beta)

    out = {"right": outcome(lambda: gemm(torch.empty(8, 16))),
           "wrong_dims": outcome(lambda: gemm(torch.empty(16, 8))),
           "wrong_dtype": outcome(lambda: gemm(torch.empty(8, 16, dtype=torch.bfloat16))),
           "beta_without_accumulate": outcome(lambda: gemm(torch.empty(8, 16), beta=0.5)),
           "beta_with_accumulate": outcome(lambda: gemm(torch.zeros(8, 16), accumulate=True, beta=0.5))}
    current = Float8CurrentScalingQuantizer(E4M3, device="cpu", with_amax_reduction=True,
                                            amax_reduction_group=dist.group.WORLD)
    te_on_cpu.reset_stats()
    empty = tex.quantize(torch.empty(0, 16), current, None, None)
    full = tex.quantize(torch.randn(4, 16), current, None, None)
    out["empty_quantize"] = {"type": type(empty).__name__, "shape": list(empty.shape),
                             "full_shape": list(full.shape),
                             "allreduces": te_on_cpu.stats().get("amax_allreduce_current_scaling", 0)}
    delayed = Float8Quantizer(torch.ones(1), torch.zeros(1), E4M3)
    noop = tex.quantize(torch.randn(4, 16), delayed, None, torch.ones(1))
    out["noop_quantize"] = {"type": type(noop).__name__, "shape": list(noop.shape) if noop is not None else None,
                            "amax": float(delayed.amax)}
    return out


def _on_hopper(rank, world_size):
    from accel_fp8_fix.rehearsal import te_on_cpu

    te_on_cpu.install()
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import Float8BlockScaling, NVFP4BlockScaling
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer

    out = {"available": {"block": list(te.is_fp8_block_scaling_available(return_reason=True)),
                         "nvfp4": list(te.is_nvfp4_available(return_reason=True))},
           "cuda_version_for_others": torch.version.cuda}
    # TE's own Python dequantizes the shim's buffers (row-wise and column-wise) to the shim's values
    torch.manual_seed(1)
    layouts = []
    for dim in (1, 2):
        for shape in ((256, 384), (200, 136), (3, 50, 130)):
            x = torch.randn(*shape) * torch.logspace(-2, 2, shape[-1])
            quantizer = Float8BlockQuantizer(E4M3, rowwise=True, columnwise=True, block_scaling_dim=dim)
            t = quantizer(x)
            rowwise = t.dequantize(dtype=torch.float32)
            shim = tex.dequantize(t, tex.DType.kFloat32)
            t.update_usage(rowwise_usage=False, columnwise_usage=True)
            columnwise = t.dequantize(dtype=torch.float32)
            layouts.append({"dim": dim, "shape": shape, "type": type(t).__name__,
                            "row_equal": torch.equal(rowwise, shim),
                            "col_close": _rel(columnwise, x) < 0.05, "row_err": _rel(rowwise, x),
                            "col_equal_2d": dim == 1 or torch.equal(columnwise, rowwise)})
    out["layouts"] = layouts
    # 2-D x 2-D is refused as cuBLAS does
    q2 = Float8BlockQuantizer(E4M3, rowwise=True, columnwise=True, block_scaling_dim=2)
    a, b = q2(torch.randn(128, 128)), q2(torch.randn(128, 128))
    try:
        tex.generic_gemm(a, True, b, False, None, None, tex.DType.kFloat32, None, tex.DType.kFloat32, False, None,
                         False, torch.empty(0), 0, False, True)
        out["gemm_2d_2d"] = None
    except RuntimeError as exc:
        out["gemm_2d_2d"] = str(exc)
    out["refusals"] = _te_refusals()
    out["block_linear"] = _linear_under(Float8BlockScaling(), torch.float32)
    out["block_linear_bf16"] = _linear_under(Float8BlockScaling(), torch.bfloat16)
    out["block_mlp"] = _layernorm_mlp_under(Float8BlockScaling(), torch.bfloat16)
    try:
        with te.autocast(enabled=True, recipe=NVFP4BlockScaling()):
            pass
        out["nvfp4_refused"] = None
    except AssertionError as exc:
        out["nvfp4_refused"] = str(exc)
    return out


def _on_blackwell(rank, world_size):
    from accel_fp8_fix.rehearsal import te_on_cpu

    te_on_cpu.install()
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import Float8BlockScaling, NVFP4BlockScaling
    from transformer_engine.pytorch.custom_recipes.reference_nvfp4 import NVFP4QuantizerRef, cast_from_fp4x2
    from transformer_engine.pytorch.custom_recipes.reference_utils import Fp4Formats
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer
    from transformer_engine.pytorch.tensor.nvfp4_tensor import NVFP4Quantizer

    out = {"available": {"block": list(te.is_fp8_block_scaling_available(return_reason=True)),
                         "nvfp4": list(te.is_nvfp4_available(return_reason=True))}}
    torch.manual_seed(2)
    exact = []
    for dtype, tile, rht, shape in ((torch.float32, (1, 16), False, (128, 256)),
                                    (torch.bfloat16, (1, 16), False, (2, 48, 160)),
                                    (torch.bfloat16, (16, 16), False, (96, 256)),
                                    (torch.bfloat16, (1, 16), True, (64, 256)),
                                    (torch.float32, (1, 16), False, (24, 200)),  # partial 16-blocks
                                    (torch.bfloat16, (16, 16), False, (40, 200))):
        x = (torch.randn(*shape) * torch.logspace(-3, 3, shape[-1])).to(dtype)
        ours = NVFP4Quantizer(rowwise=True, columnwise=True, with_rht=rht, with_post_rht_amax=rht,
                              with_2d_quantization=tile == (16, 16))(x)
        ref = NVFP4QuantizerRef(dtype=Fp4Formats.E2M1, rowwise=True, columnwise=True, quant_tile_shape=tile,
                                with_rht=rht).quantize(x)
        m, k = math.prod(shape[:-1]), shape[-1]
        row_scales = ours._rowwise_scale_inv[:m, : -(-k // 16)]
        col_scales = ours._columnwise_scale_inv[:k, : -(-m // 16)]
        # dequantization (dequantize_fp4_kernel) against TE's reference decoding of the reference's bits
        ref_values = cast_from_fp4x2(ref.data.reshape(m, k // 2), torch.float32)
        ref_factors = (ref.scale[:m].float() * ref.global_amax_row / (6.0 * 448.0)).repeat_interleave(16, 1)[:, :k]
        ref_dq = (ref_values * ref_factors).reshape(shape)
        exact.append({
            "case": f"{dtype} {tile} rht={rht} {shape}", "type": type(ours).__name__,
            "data": torch.equal(ours._rowwise_data.reshape(m, k // 2), ref.data.reshape(m, k // 2)),
            "data_t": torch.equal(ours._columnwise_data.reshape(k, m // 2), ref.data_t),
            "scales": torch.equal(row_scales, ref.scale.view(torch.uint8)[:m]),  # (the reference pads 2-D tiles)
            "scales_t": torch.equal(col_scales, ref.scale_t.view(torch.uint8)[:k]),
            "amax": [float(ours._amax_rowwise), float(ref.global_amax_row), float(ours._amax_columnwise),
                     float(ref.global_amax_col)],
            "scale_shapes": [list(ours._rowwise_scale_inv.shape), list(ours._columnwise_scale_inv.shape)],
            "dequantize": bool(torch.allclose(ours.dequantize(dtype=torch.float32), ref_dq, rtol=1e-6, atol=0)),
        })
    out["exact"] = exact
    # 2-D weights: TE's own _create_columnwise (tex.nvfp4_data_transpose + nvfp4_2d_scale_transpose) rebuilds the
    # column-wise buffers a direct column-wise cast writes
    w = torch.randn(256, 128, dtype=torch.bfloat16)
    both = NVFP4Quantizer(rowwise=True, columnwise=True, with_2d_quantization=True)(w)
    rowonly = NVFP4Quantizer(rowwise=True, columnwise=False, with_2d_quantization=True)(w)
    rowonly._create_columnwise()
    out["create_columnwise"] = (torch.equal(rowonly._columnwise_data, both._columnwise_data)
                                and torch.equal(rowonly._columnwise_scale_inv[:, :16], both._columnwise_scale_inv[:, :16]))
    # stochastic rounding: the expectation of the quantized values is the input (round-to-nearest is biased)
    g = torch.full((64, 256), 0.37, dtype=torch.bfloat16) * torch.linspace(0.5, 1.0, 256).to(torch.bfloat16)
    sr = NVFP4Quantizer(rowwise=True, columnwise=False, stochastic_rounding=True)
    rn = NVFP4Quantizer(rowwise=True, columnwise=False)
    mean_sr = torch.stack([sr(g).dequantize(dtype=torch.float32) for _ in range(64)]).mean(0)
    out["sr"] = {"sr_bias": float((mean_sr - g.float()).mean().abs()),
                 "rn_bias": float((rn(g).dequantize(dtype=torch.float32) - g.float()).mean().abs())}
    out["nvfp4_linear"] = _linear_under(NVFP4BlockScaling(), torch.bfloat16)
    try:  # TE's quantizer.cpp: the Hadamard transform takes bf16 only
        NVFP4Quantizer(rowwise=True, columnwise=True, with_rht=True, with_post_rht_amax=True)(torch.randn(32, 64))
        out["rht_fp32_refused"] = None
    except RuntimeError as exc:
        out["rht_fp32_refused"] = str(exc)
    out["nvfp4_mlp"] = _layernorm_mlp_under(NVFP4BlockScaling(), torch.bfloat16)
    # amax reduction (TE asks for it for sequence-parallel inputs and FSDP2-sharded FP4 weights): MAX over the group
    import torch.distributed as dist

    te_on_cpu.reset_stats()
    reduced = NVFP4Quantizer(rowwise=True, columnwise=True, with_amax_reduction=True,
                             amax_reduction_group=dist.group.WORLD)(w)
    count = te_on_cpu.stats().get("amax_allreduce_nvfp4", 0)
    local = NVFP4Quantizer(rowwise=True, columnwise=True)(w)  # one rank: the reduced amax is the local one
    out["amax_reduction"] = {"count": count,
                             "same": torch.equal(reduced._rowwise_data, local._rowwise_data)
                             and torch.equal(reduced._amax_rowwise, w.float().abs().amax().reshape(1))}
    out["block_linear"] = _linear_under(Float8BlockScaling(), torch.bfloat16)  # emulated with MXFP8 on Blackwell
    try:
        Float8BlockQuantizer(E4M3, rowwise=True, columnwise=False, force_pow_2_scales=False)(torch.randn(128, 128))
        out["fp32_scales_refused"] = None
    except RuntimeError as exc:
        out["fp32_scales_refused"] = str(exc)
    # per-tensor FP8 in training with 24 tokens (8 mod 16): Blackwell's FP8 GEMMs take any layout, so the
    # weight-gradient GEMM's leading dimension is not the tokens — TE runs it, and the package's check lets it
    from transformer_engine.common.recipe import DelayedScaling

    from accel_fp8_fix.fixes.convert.fp8_shapes import install_token_check

    out["train24"] = {}
    for checked in (False, True):
        module = te.Linear(32, 32)
        if checked:
            install_token_check(module, "blocks.0.fc1")
        try:
            with te.autocast(enabled=True, recipe=DelayedScaling()):
                y = module(torch.randn(24, 32, requires_grad=True))
            y.sum().backward()
            out["train24"][str(checked)] = None
        except (ValueError, RuntimeError) as exc:
            out["train24"][str(checked)] = f"{type(exc).__name__}: {exc}"
    return out


def _on_ada(rank, world_size):
    from accel_fp8_fix.rehearsal import te_on_cpu

    te_on_cpu.install()
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import Float8BlockScaling

    try:
        with te.autocast(enabled=True, recipe=Float8BlockScaling()):
            pass
        return None
    except RuntimeError as exc:
        return str(exc)


@pytest.fixture(scope="module")
def hopper():
    (result,) = launcher.run(_on_hopper, 1, env={"ACCEL_FP8_FIX_CPU_TE_ARCH": "sm90"}, timeout=180)
    return result


@pytest.fixture(scope="module")
def blackwell():
    (result,) = launcher.run(_on_blackwell, 1, env={"ACCEL_FP8_FIX_CPU_TE_ARCH": "sm100"}, timeout=180)
    return result


def test_training_with_24_tokens_runs_on_blackwell_and_the_token_check_lets_it(blackwell):
    """The Hopper side (refused: the weight-gradient GEMM's lda is the tokens there) is in test_te_on_cpu.py."""
    assert blackwell["train24"] == {"False": None, "True": None}, blackwell["train24"]


def test_te_decides_support_as_on_the_real_gpus(hopper, blackwell):
    assert hopper["available"] == {"block": [True, ""], "nvfp4": [
        False, "Device compute capability 10.0 or higher required for NVFP4 execution."]}
    assert blackwell["available"] == {"block": [True, ""], "nvfp4": [True, ""]}
    assert hopper["cuda_version_for_others"] is None  # only TE's frames read a CUDA version


def test_nvfp4_on_hopper_is_refused_with_tes_message(hopper):
    assert hopper["nvfp4_refused"] == "Device compute capability 10.0 or higher required for NVFP4 execution."


def test_block_scaling_on_ada_is_refused_with_tes_message():
    (message,) = launcher.run(_on_ada, 1, env={"ACCEL_FP8_FIX_CPU_TE_ARCH": "sm89"}, timeout=180)
    assert message == "FP8 block scaled GEMM requires compute capability 9.0 or higher and CUDA >= 12.9."


def test_tes_python_reads_the_shims_block_layouts(hopper):
    for case in hopper["layouts"]:
        assert case["type"] == "Float8BlockwiseQTensor"
        assert case["row_equal"] and case["col_close"] and case["col_equal_2d"], case
        assert 0.005 < case["row_err"] < 0.05, case  # E4M3 with power-of-two block scales


def test_gemm_output_and_beta_are_checked_as_te_checks_them(hopper):
    """TE's gemm.cpp refuses a D of the wrong shape or dtype and beta without accumulate; the shim copied a
    same-size D of another shape and ignored beta (issue 28 item 2)."""
    r = hopper["refusals"]
    assert r["right"] == "returned list" and r["beta_with_accumulate"] == "returned list"
    assert r["wrong_dims"] == "refused: GEMM output has invalid dims (expected (8,16), got (16,8))"
    assert r["wrong_dtype"] == "refused: GEMM output has invalid dtype (expected 4, found 6)"
    assert r["beta_without_accumulate"] == ("refused: Trying to use non-zero beta while not accumulating into D "
                                            "tensor. Beta has nothing to be applied to.")


def test_an_empty_quantize_returns_before_its_amax_all_reduce_and_the_noop_flag_returns_a_tensor(hopper):
    """TE's quantize_impl returns on numel() == 0 before the current-scaling amax all-reduce (a rank with no tokens
    issues no collective on a GPU); with the no-op flag set it allocates and returns an untouched tensor (the shim
    returned None)."""
    empty, noop = hopper["refusals"]["empty_quantize"], hopper["refusals"]["noop_quantize"]
    assert empty == {"type": "Float8Tensor", "shape": [0, 16], "full_shape": [4, 16], "allreduces": 1}
    assert noop == {"type": "Float8Tensor", "shape": [4, 16], "amax": 0.0}


def test_block_gemm_2d_by_2d_is_refused_as_cublas_does(hopper):
    assert hopper["gemm_2d_2d"].startswith("Only 1D by 1D, 1D by 2D, and 2D by 1D block scaling GEMM is supported")


@pytest.mark.parametrize("case", ["block_linear", "block_linear_bf16"])
def test_linear_under_float8_block_scaling_on_hopper(hopper, case):
    result = hopper[case]
    stats = result["stats"]
    assert (stats["fp8_gemms_fwd"], stats["fp8_gemms_bwd"], stats["fp8_block_gemms"], stats["non_fp8_gemms"]) == (1, 2, 3, 0)
    assert stats["quantize_Float8BlockQuantizer"] >= 3
    for grad in ("y", "dx", "dw"):  # E4M3 resolution; above it only if the cast were skipped
        assert 0.005 < result[grad] < 0.06, (grad, result)


def test_nvfp4_quantize_matches_tes_reference_bit_for_bit(blackwell):
    for case in blackwell["exact"]:
        assert case["type"] == "NVFP4Tensor"
        assert case["data"] and case["data_t"] and case["scales"] and case["scales_t"], case
        assert case["amax"][0] == case["amax"][1] and case["amax"][2] == case["amax"][3], case
        assert case["dequantize"], case
    padded = blackwell["exact"][0]["scale_shapes"]  # (128, 256): NVFP4Quantizer.get_scale_shape
    assert padded == [[128, 16], [256, 8]]


def test_nvfp4_2d_columnwise_from_rowwise_and_stochastic_rounding(blackwell):
    assert blackwell["create_columnwise"]
    assert blackwell["sr"]["sr_bias"] < 0.25 * blackwell["sr"]["rn_bias"]


def test_nvfp4_hadamard_transform_of_fp32_is_refused_with_tes_message_and_the_way_out(blackwell):
    message = blackwell["rht_fp32_refused"]
    assert message.startswith("RHT is only supported for bfloat16 input, got dtype enum value 4")
    assert "NVTE_NVFP4_DISABLE_RHT=1" in message


def test_linear_under_nvfp4_on_blackwell(blackwell):
    result = blackwell["nvfp4_linear"]
    stats = result["stats"]
    assert (stats["fp8_gemms_fwd"], stats["fp8_gemms_bwd"], stats["nvfp4_gemms"], stats["non_fp8_gemms"]) == (1, 2, 3, 0)
    # E2M1 resolution (~10 % per operand); dW contracts two Hadamard-transformed operands, which cancel
    for grad in ("y", "dx", "dw"):
        assert 0.03 < result[grad] < 0.25, (grad, result)


@pytest.mark.parametrize("arch, case, bound", [("hopper", "block_mlp", 0.06), ("blackwell", "nvfp4_mlp", 0.25)])
def test_layernorm_mlp_runs_all_six_gemms_quantized(hopper, blackwell, arch, case, bound):
    result = {"hopper": hopper, "blackwell": blackwell}[arch][case]
    assert (result["fwd"], result["bwd"], result["hp"]) == (2, 4, 0)
    assert 0.005 < result["rel_err"] < bound, result


def test_nvfp4_amax_reduction_runs_on_the_group(blackwell):
    assert blackwell["amax_reduction"] == {"count": 1, "same": True}


def test_block_scaling_on_blackwell_needs_power_of_two_scales(blackwell):
    result = blackwell["block_linear"]
    assert result["stats"]["fp8_block_gemms"] == 3 and all(result[g] < 0.06 for g in ("y", "dx", "dw"))
    assert blackwell["fp32_scales_refused"].startswith("On Blackwell and newer, the FP8 block scaling recipe is "
                                                       "emulated with MXFP8")


# -- issue 17 item 4: MXFP8 E8M0 endpoints, bit for bit from TE 2.20's ptx.cuh -----------------------------------
def _kernel_exp2f_rcp_bits(e: int) -> int:
    """``ptx::exp2f_rcp<float>`` (common/util/ptx.cuh since TE PR #2647, in release_v2.19 and 2.20): 255 is
    NaN (0x7fffffff), 254 gives 2**-127 (0x00400000: not reachable by an exponent shift), else (254 - e) << 23."""
    if e == 255:
        return 0x7FFFFFFF
    if e == 254:
        return 0x00400000
    return ((254 - e) << 23) & 0xFFFFFFFF


def _kernel_exp2f_bits(e: int) -> int:
    """``ptx::exp2f`` (the dequantization factor; PR #3262, release_v2.19 and 2.20): 255 is NaN (0x7fffffff),
    0 gives 2**-127 (0x00400000), else e << 23."""
    if e == 255:
        return 0x7FFFFFFF
    if e == 0:
        return 0x00400000
    return e << 23


@pytest.mark.parametrize("inverse, kernel", [(True, _kernel_exp2f_rcp_bits), (False, _kernel_exp2f_bits)])
def test_e8m0_factors_are_the_kernels_bits_at_every_code(inverse, kernel):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = tex.e8m0_to_scale(codes, inverse=inverse).view(torch.int32).tolist()
    assert [g & 0xFFFFFFFF for g in got] == [kernel(e) for e in range(256)]
    f = tex.e8m0_to_scale(torch.tensor([0, 1, 127, 253, 254, 255], dtype=torch.uint8), inverse=inverse).tolist()
    if inverse:  # 2**127 at code 0 (TE 2.20 has no special case there; TE <= 2.12 returned 1), 2**-127 at 254
        assert f[:5] == [2.0 ** 127, 2.0 ** 126, 1.0, 2.0 ** -126, 2.0 ** -127] and math.isnan(f[5])
    else:
        assert f[:5] == [2.0 ** -127, 2.0 ** -126, 1.0, 2.0 ** 126, 2.0 ** 127] and math.isnan(f[5])


def test_mxfp8_endpoint_blocks_quantize_as_the_kernel():
    x = torch.zeros(1, 96)
    x[0, 0], x[0, 1] = float("inf"), 3.0  # block 0: amax inf -> e8m0 254 -> multiplier 2**-127: inf*2**-127 = inf,
    x[0, 32] = 1e-39  # satfinite 448; 3*2**-127 underflows to 0. Block 1: tiny amax -> e8m0 0 -> multiplier 2**127
    x[0, 64] = float("nan")  # block 2: NaN ignored by the amax (0) -> e8m0 0; NaN stays NaN
    bits, e = tex.mxfp8_quantize_2d(x, E4M3, columnwise=False)
    assert e.tolist() == [[254, 0, 0]]
    values = tex.fp8_bits_to_float(bits, E4M3)[0]
    assert values[0].item() == 448.0 and values[1].item() == 0.0
    assert values[32].item() == _reference_fp8_e4m3(1e-39 * 2.0 ** 127)
    assert math.isnan(values[64].item())


def _reference_fp8_e4m3(v: float) -> float:
    return float(tex.fp8_bits_to_float(tex.cast_to_fp8(torch.tensor([v]), torch.ones(1), E4M3), E4M3)[0])


# -- issue 17 item 4: Hopper FP8 fast accumulation (ACCEL_FP8_FIX_REHEARSAL_FAST_ACCUM=1) -------------------------
def _model_dot(xs, ys, bits=13, chunk=32) -> float:
    """The documented model on Python floats: per 32 products (one wgmma), running sum + exact chunk sum, then cut
    to 1 + 13 significant bits toward zero; never promoted."""
    acc = 0.0
    for k0 in range(0, len(xs), chunk):
        acc += math.fsum(x * y for x, y in zip(xs[k0:k0 + chunk], ys[k0:k0 + chunk]))
        if acc != 0.0:
            m, e = math.frexp(acc)
            acc = math.ldexp(math.trunc(m * 2 ** (bits + 1)), e - bits - 1)
    return acc


def _fp8_operand(values: torch.Tensor, scale_inv: float):
    """A per-tensor FP8 (E4M3) operand as the shim reads it: row-wise data, one scale_inv."""
    from types import SimpleNamespace

    bits = tex.cast_to_fp8(values, torch.ones(1), E4M3)
    return SimpleNamespace(_data=bits, _transpose=None, _transpose_invalid=True,
                                 _scale_inv=torch.tensor([scale_inv]), _fp8_dtype=E4M3)


def _tn_gemm(a, b, split: bool):
    """TE's fprop layout: D [M, N] = B [M, K] @ A [N, K]^T (transa=True, transb=False)."""
    out, *_ = tex.generic_gemm(a, True, b, False, None, None, None, None, tex.DType.kFloat32, False, None, False,
                               torch.empty(0), 0, False, split)
    return out


def test_fast_accumulation_follows_the_model_and_split_accumulation_is_exact(monkeypatch):
    monkeypatch.delenv("ACCEL_FP8_FIX_CPU_TE_ARCH", raising=False)
    monkeypatch.delenv("ACCEL_FP8_FIX_REHEARSAL_TARGET", raising=False)
    # swamping: 128*128 = 2**14 first, then a product of 1 per wgmma: the e8m13 accumulator (ulp 2 at 2**14)
    # drops every one of them; split accumulation keeps them
    xs = torch.zeros(1, 128)
    ws = torch.zeros(1, 128)
    xs[0, 0] = ws[0, 0] = 128.0
    for k in (40, 72, 104):
        xs[0, k] = ws[0, k] = 1.0
    a, b = _fp8_operand(ws, 0.5), _fp8_operand(xs, 0.25)
    monkeypatch.setenv(tex.ENV_FAST_ACCUM, "1")
    tex.reset_stats()
    assert _tn_gemm(a, b, split=False).item() == 16384.0 * 0.125
    assert tex.stats()["fast_accum_gemms"] == 1
    assert _tn_gemm(a, b, split=True).item() == 16387.0 * 0.125
    monkeypatch.setenv(tex.ENV_FAST_ACCUM, "0")
    assert _tn_gemm(a, b, split=False).item() == 16387.0 * 0.125  # default: exact fp32, the flag ignored
    assert tex.stats()["fast_accum_gemms"] == 1

    # random FP8 operands: bit for bit the model (Python floats), and off the exact product by at most the
    # accumulator's truncation: K/32 cuts of < 2**-13 relative each
    torch.manual_seed(0)
    m, n, k = 6, 5, 1024
    x = tex.fp8_bits_to_float(tex.cast_to_fp8(torch.randn(m, k) * 20, torch.ones(1), E4M3), E4M3)
    w = tex.fp8_bits_to_float(tex.cast_to_fp8(torch.rand(n, k) * 10, torch.ones(1), E4M3), E4M3)
    a, b = _fp8_operand(w, 1.0), _fp8_operand(x, 1.0)
    monkeypatch.setenv(tex.ENV_FAST_ACCUM, "1")
    fast, split = _tn_gemm(a, b, split=False), _tn_gemm(a, b, split=True)
    exact = (x.double() @ w.double().t())
    model = torch.tensor([[_model_dot(x[i].tolist(), w[j].tolist()) for j in range(n)] for i in range(m)])
    assert torch.equal(fast, model.float())
    assert torch.allclose(split.double(), exact, rtol=1e-6, atol=1e-3)  # fp32 reference GEMM
    assert not torch.equal(fast, split)
    bound = (k // 32) * 2.0 ** -13 * (x.double().abs() @ w.double().abs().t())
    assert bool(((fast.double() - exact).abs() <= bound).all())
    # modelled on Hopper only: a Blackwell profile answers exact; a wrong value is refused by name
    monkeypatch.setenv("ACCEL_FP8_FIX_REHEARSAL_TARGET", "b200-cu130")
    assert torch.equal(_tn_gemm(a, b, split=False), split)
    monkeypatch.setenv(tex.ENV_FAST_ACCUM, "yes")
    with pytest.raises(ValueError, match="ACCEL_FP8_FIX_REHEARSAL_FAST_ACCUM='yes'"):
        _tn_gemm(a, b, split=False)


def _fast_accum_linear(rank, world_size):
    from accel_fp8_fix.rehearsal import te_on_cpu

    te_on_cpu.install()
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling

    out = {}
    for name, recipe in (("delayed", DelayedScaling()), ("current", Float8CurrentScaling())):
        torch.manual_seed(0)
        layer = te.Linear(256, 64)
        x = torch.randn(32, 256, requires_grad=True)
        te_on_cpu.reset_stats()
        with te.autocast(enabled=True, recipe=recipe):
            y = layer(x)
        y.float().sum().backward()
        s = te_on_cpu.stats()
        out[name] = {"fast": s.get("fast_accum_gemms", 0), "fwd": s["fp8_gemms_fwd"], "bwd": s["fp8_gemms_bwd"]}
    return out


def test_te_asks_for_fast_accumulation_in_fprop_only():
    (result,) = launcher.run(_fast_accum_linear, 1, env={"ACCEL_FP8_FIX_REHEARSAL_FAST_ACCUM": "1",
                                                            "ACCEL_FP8_FIX_CPU_TE_ARCH": "sm90"}, timeout=180)
    # TE's _2X_ACC_FPROP (False) for delayed scaling, Float8CurrentScaling.fp8_gemm_fprop for current scaling;
    # dgrad and wgrad keep split accumulation (_2X_ACC_DGRAD / _2X_ACC_WGRAD, the recipe's MMParams)
    assert result == {"delayed": {"fast": 1, "fwd": 1, "bwd": 2}, "current": {"fast": 1, "fwd": 1, "bwd": 2}}
