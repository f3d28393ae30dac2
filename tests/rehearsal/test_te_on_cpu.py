"""The CPU kernel shim under Transformer Engine's real Python (accel_fp8_fix.rehearsal.te_on_cpu).

Kernels against references written from TE's CUDA sources (cast: ``cvt.rn.satfinite``; delayed
scaling: ``common/recipe/delayed_scaling.cu``; current scaling: ``recipe_common.cuh``), then checks
that need TE's Python loaded run in one fresh rank: FP8 state loading without the unsafe-pickle opt-in
(A12), FP8 GEMM shapes (A11), and the CUDA-as-CPU answers staying inside TE's frames.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from accel_fp8_fix.rehearsal.te_on_cpu import tex
from support import launcher
from support import scenarios

E4M3, E5M2 = tex.DType.kFloat8E4M3, tex.DType.kFloat8E5M2


# -- reference FP8 formats, from the bit layout (not from torch) --------------------------------------------
def _fp8_values(exp_bits: int, man_bits: int, bias: int, fn: bool):
    """{bits: value} of every finite non-negative value of an FP8 format (``fn``: E4M3FN, no infinities)."""
    values = {}
    for e in range(2 ** exp_bits):
        for m in range(2 ** man_bits):
            if e == 2 ** exp_bits - 1 and (not fn or m == 2 ** man_bits - 1):
                continue  # inf / NaN encodings
            value = (m / 2 ** man_bits) * 2.0 ** (1 - bias) if e == 0 else (1 + m / 2 ** man_bits) * 2.0 ** (e - bias)
            values[(e << man_bits) | m] = value
    return values


FORMATS = {E4M3: _fp8_values(4, 3, 7, True), E5M2: _fp8_values(5, 2, 15, False)}


def _reference_cast(x: float, fmt) -> float:
    """Round to nearest, ties to the even encoding, saturating to the largest finite value."""
    grid = sorted(FORMATS[fmt].items(), key=lambda kv: kv[1])
    top = grid[-1][1]
    a = min(abs(x), top)
    lower = max((kv for kv in grid if kv[1] <= a), key=lambda kv: kv[1])
    upper = min((kv for kv in grid if kv[1] >= a), key=lambda kv: kv[1])
    if a - lower[1] < upper[1] - a:
        pick = lower
    elif a - lower[1] > upper[1] - a:
        pick = upper
    else:
        pick = lower if lower[0] % 2 == 0 else upper
    return math.copysign(pick[1], x)


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_cast_rounds_to_nearest_even_and_saturates(fmt):
    grid = sorted(FORMATS[fmt].values())
    midpoints = [(a + b) / 2 for a, b in zip(grid, grid[1:])]  # every tie
    quarter = [a + (b - a) / 4 for a, b in zip(grid, grid[1:])] + [a + 3 * (b - a) / 4 for a, b in zip(grid, grid[1:])]
    beyond = [grid[-1] * 1.01, grid[-1] * 1.5, 1e30, float("inf")]
    xs = midpoints + quarter + beyond
    xs = xs + [-v for v in xs]
    got = tex.fp8_bits_to_float(tex.cast_to_fp8(torch.tensor(xs), torch.ones(1), fmt), fmt).tolist()
    want = [_reference_cast(x, fmt) for x in xs]
    assert got == want
    assert max(got) == {E4M3: 448.0, E5M2: 57344.0}[fmt]  # satfinite: inf -> the largest finite value
    nan = tex.fp8_bits_to_float(tex.cast_to_fp8(torch.tensor([float("nan")]), torch.ones(1), fmt), fmt)
    assert torch.isnan(nan).all()


def test_cast_applies_the_scale_before_rounding():
    x = torch.tensor([0.1, 1.0, 3.0])
    scale = torch.tensor([37.0])
    got = tex.fp8_bits_to_float(tex.cast_to_fp8(x, scale, E4M3), E4M3).tolist()
    assert got == [_reference_cast(float(v) * 37.0, E4M3) for v in torch.tensor([0.1, 1.0, 3.0]).float()]


# -- delayed scaling: the fused update kernel -------------------------------------------------------------
def _run_update(amaxes, length=4, algo="max", margin=0, fmt=E4M3, scale=1.0):
    history = torch.zeros(length, 1)
    scales = torch.full((1,), scale)
    out = []
    for amax in amaxes:
        history[0, 0] = amax  # what the casts of the step accumulated
        tex.fused_amax_and_scale_update_after_reduction(torch.zeros(1), [history], [scales], algo, fmt, margin)
        out.append(float(scales[0]))
    return out, history


def test_zero_amax_steps_neither_roll_the_history_nor_change_the_scale():
    # te-real-behaviour.md's example: history 4, amax 8, 0, 0, 0, 1 -> scale 56 at step 5 (an always-rolling
    # update would have dropped the 8 and given 448 / 1 = 448)
    scales, history = _run_update([8.0, 0.0, 0.0, 0.0, 1.0])
    assert scales == [56.0] * 5
    assert history[:, 0].tolist() == [0.0, 0.0, 8.0, 1.0]


def test_update_most_recent_margin_nan_and_inf():
    assert _run_update([8.0, 2.0], algo="most_recent")[0] == [56.0, 224.0]
    assert _run_update([8.0], margin=1)[0] == [28.0]  # (448 / 2**margin) / amax
    assert _run_update([float("nan")], scale=3.0)[0] == [3.0]  # NaN ignored by the max: amax 0, scale kept
    assert _run_update([float("inf")], scale=3.0)[0] == [3.0]  # non-finite amax: scale kept
    assert _run_update([1e-45])[0] == [torch.finfo(torch.float32).max]  # infinite scale -> FLT_MAX
    assert _run_update([8.0], fmt=E5M2)[0] == [57344.0 / 8]


def test_reduced_amax_takes_precedence_over_the_local_one():
    history, scales = torch.zeros(4, 2), torch.ones(2)
    history[0] = torch.tensor([1.0, 2.0])
    tex.fused_amax_and_scale_update_after_reduction(torch.tensor([4.0, 0.0]), [history], [scales], "max", E4M3, 0)
    assert scales.tolist() == [112.0, 224.0]  # slot 0 from the reduction buffer, slot 1 (buffer 0) local


def _kernel_bulk_one_slot_at_a_time(buffer, histories, scales, algo, fmt, margin):
    """``delayed_scaling.cu``'s ``kernel_bulk`` as its threads run it, one scale slot each (the shim's own code
    before it took every slot of a history at once): the reference the shim's update is held to, bit for bit."""
    fp8_max = {E4M3: 448.0, E5M2: 57344.0}[fmt]
    scaled_max = torch.tensor(fp8_max, dtype=torch.float32) / (2.0 ** margin)
    offset = 0
    for history, scale in zip(histories, scales):
        h, s = history.view(history.shape[0], -1), scale.view(-1)
        for c in range(s.numel()):
            reduced = float(buffer[offset + c]) if buffer is not None else 0.0
            last = reduced if reduced != 0.0 else float(h[0, c])
            amax = 0.0
            if last != 0.0:
                window = torch.cat([h[1:, c], torch.tensor([last], dtype=h.dtype)])
                amax = float(torch.where(torch.isnan(window), 0.0, window).max().clamp_min(0.0))
                h[:, c] = torch.cat([torch.zeros(1, dtype=h.dtype), window[1:]])
            amax = last if algo == "most_recent" else amax if algo == "max" else 0.0
            new = (scaled_max / torch.tensor(amax, dtype=torch.float32) if math.isfinite(amax) and amax > 0
                   else s[c].float())
            s[c] = torch.tensor(torch.finfo(torch.float32).max) if torch.isinf(new) else new
        offset += s.numel()


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_the_update_of_every_slot_at_once_equals_the_kernel_one_slot_at_a_time(algo):
    g = torch.Generator().manual_seed(3)
    special = torch.tensor([0.0, float("nan"), float("inf"), 1e-45, 3e38, -0.0])
    for trial in range(40):
        length = int(torch.randint(1, 5, (1,), generator=g))  # TE's layout: one history length per call
        shapes = [(length if trial % 2 else int(torch.randint(1, 5, (1,), generator=g)),
                   int(torch.randint(1, 4, (1,), generator=g))) for _ in range(3)]
        histories = [torch.rand(shape, generator=g) * 10 for shape in shapes]
        for h in histories:  # zeros, NaN, inf and denormal amaxes where the kernel branches
            picks = torch.rand(h.shape, generator=g) < 0.3
            h[picks] = special[torch.randint(0, len(special), (int(picks.sum()),), generator=g)]
        scales = [torch.rand(shape[1], generator=g) + 0.5 for shape in shapes]
        slots = sum(shape[1] for shape in shapes)
        buffer = None if trial % 5 == 0 else torch.where(torch.rand(slots, generator=g) < 0.5, 0.0,
                                                           torch.rand(slots, generator=g) * 20)
        margin, fmt = trial % 3, (E4M3, E5M2)[trial % 2]
        want_h, want_s = [h.clone() for h in histories], [s.clone() for s in scales]
        _kernel_bulk_one_slot_at_a_time(buffer, want_h, want_s, algo, fmt, margin)
        tex.fused_amax_and_scale_update_after_reduction(buffer, histories, scales, algo, fmt, margin)
        for got, want in zip(histories + scales, want_h + want_s):  # bit for bit, NaN where NaN
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (trial, got, want)


def test_current_scaling_scale_from_amax():
    assert tex.scale_from_amax(2.0, 448.0, False, 0.0) == 224.0
    assert tex.scale_from_amax(3.0, 448.0, True, 0.0) == 128.0  # 149.33 with its mantissa cleared
    assert tex.scale_from_amax(0.0, 448.0, False, 0.0) == 1.0
    assert tex.scale_from_amax(0.0, 448.0, False, 4.0) == 112.0  # amax floored at epsilon
    assert tex.scale_from_amax(float("inf"), 448.0, False, 0.0) == 1.0


def test_an_op_the_shim_lacks_says_so_by_name():
    with pytest.raises(NotImplementedError, match="transformer_engine_torch.fused_rope_forward"):
        tex.fused_rope_forward(torch.zeros(1))
    # a quantizer kind the shim has no kernel for is named, with the kinds it has (block scaling and NVFP4
    # among them since issue 12)
    with pytest.raises(NotImplementedError, match="quantize with HybridQuantizer") as refused:
        tex.quantize(torch.zeros(1), type("HybridQuantizer", (), {})())
    assert "Float8BlockQuantizer" in str(refused.value) and "NVFP4Quantizer" in str(refused.value)


# -- with TE's Python loaded (one fresh rank) ----------------------------------------------------------------
def _with_te(rank, world_size):
    import io
    import pickle

    import torch

    from accel_fp8_fix.rehearsal import te_on_cpu

    te_on_cpu.install()
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling, Format

    from accel_fp8_fix.fixes.convert.fp8_shapes import install_token_check
    from accel_fp8_fix.fixes.checkpoint.fp8_state_loading import NonConformingExtraState, install_safe_loading

    out = {"unsafe_env": os.environ.get("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE")}
    torch.manual_seed(0)
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=8)
    trained = te.Linear(32, 32)
    for _ in range(2):
        with te.autocast(enabled=True, recipe=recipe):
            trained(torch.randn(16, 32, requires_grad=True)).sum().backward()
    sd = trained.state_dict()
    meta = trained.fp8_meta["scaling_fwd"]

    def fresh(safe):
        module = te.Linear(32, 32)
        if safe:
            install_safe_loading(module)
        return module

    try:  # A12 stock: TE >= 2.18 refuses its own delayed-scaling checkpoint
        fresh(False).load_state_dict(sd)
        out["stock"] = None
    except RuntimeError as exc:
        out["stock"] = str(exc)
    loaded = fresh(True)
    loaded.load_state_dict(sd)
    lm = loaded.fp8_meta["scaling_fwd"]
    out["loaded_equal"] = (torch.equal(lm.scale, meta.scale) and torch.equal(lm.amax_history, meta.amax_history)
                           and loaded.fp8_meta["recipe"].amax_history_len == 8)

    class Payload:  # what an attacker would put into _extra_state
        def __reduce__(self):
            return (os.system, ("touch /tmp/accel_fp8_fix_pwned",))

    evil = dict(sd)
    evil["_extra_state"] = torch.frombuffer(bytearray(pickle.dumps({"recipe": Payload()})), dtype=torch.uint8)
    try:
        fresh(True).load_state_dict(evil)
        out["evil"] = None
    except NonConformingExtraState as exc:
        out["evil"] = str(exc)
    out["evil_ran"] = os.path.exists("/tmp/accel_fp8_fix_pwned")

    # TE 1.x wrote io.BytesIO(torch.save({scale_fwd, scale_inv_fwd, amax_history_fwd, ...})) without a recipe
    # (its recipe, DelayedScaling(), is implied: amax_history_len 1024)
    def history_1024(h):
        return torch.cat([h, torch.zeros(1024 - h.shape[0], h.shape[1])])

    legacy = io.BytesIO()
    torch.save({"scale_fwd": meta.scale.clone(), "scale_inv_fwd": 1 / meta.scale,
                "amax_history_fwd": history_1024(meta.amax_history),
                "scale_bwd": trained.fp8_meta["scaling_bwd"].scale.clone(), "scale_inv_bwd": torch.ones(2),
                "amax_history_bwd": history_1024(trained.fp8_meta["scaling_bwd"].amax_history),
                "extra_fp8_variables": {"num_gemms": 1}}, legacy)
    old = fresh(True)
    old.set_extra_state(legacy)
    out["legacy_equal"] = (torch.equal(old.fp8_meta["scaling_fwd"].scale, meta.scale)
                           and torch.equal(old.fp8_meta["scaling_fwd"].amax_history, history_1024(meta.amax_history))
                           and type(old.fp8_meta["recipe"]).__name__ == "DelayedScaling")

    # A11: four tokens on this rank
    for checked in (False, True):
        module = te.Linear(32, 32)
        if checked:
            install_token_check(module, "blocks.0.fc1")
        try:
            with te.autocast(enabled=True, recipe=recipe):
                module(torch.randn(4, 32))
            out[f"shape_{checked}"] = None
        except ValueError as exc:
            out[f"shape_{checked}"] = str(exc)
    # A11 in training (Hopper, the default target): 24 tokens, a multiple of 8 but not 16, pass TE's own forward
    # check; the weight-gradient GEMM of the backward (k = the tokens) is refused by cuBLASLt's FP8 rule
    out["train24"] = {}
    for case in ("stock", "checked", "no_grad", "frozen", "forward_only"):
        module = te.Linear(32, 32)
        if case != "stock":
            install_token_check(module, "blocks.0.fc1")
        if case == "frozen":
            module.weight.requires_grad_(False)  # no weight gradient: TE skips that GEMM
        try:
            with torch.set_grad_enabled(case != "no_grad"), te.autocast(enabled=True, recipe=recipe):
                y = module(torch.randn(24, 32, requires_grad=True))
            if case not in ("no_grad", "forward_only"):
                y.sum().backward()
            out["train24"][case] = None
        except (ValueError, RuntimeError) as exc:
            out["train24"][case] = f"{type(exc).__name__}: {exc}"
    # the other recipe and module the shim covers: current scaling on a Linear, LayerNormMLP (GELU epilogues)
    from transformer_engine.common.recipe import Float8CurrentScaling

    x = torch.randn(16, 32, requires_grad=True)
    te_on_cpu.reset_stats()
    linear = te.Linear(32, 32)
    with te.autocast(enabled=True, recipe=Float8CurrentScaling()):
        y = linear(x)
    y.sum().backward()
    reference = torch.nn.functional.linear(x, linear.weight, linear.bias)
    stats = te_on_cpu.stats()
    out["current_scaling"] = {"fp8_gemms": stats["fp8_gemms"], "casts": stats.get("quantize_Float8CurrentScalingQuantizer", 0),
                              "rel_err": float((y - reference).detach().norm() / reference.detach().norm())}
    te_on_cpu.reset_stats()
    mlp = te.LayerNormMLP(32, 64)
    with te.autocast(enabled=True, recipe=recipe):
        y = mlp(x)
    y.sum().backward()
    h = torch.nn.functional.layer_norm(x, (32,), mlp.layer_norm_weight, mlp.layer_norm_bias, eps=mlp.eps)
    h = torch.nn.functional.gelu(torch.nn.functional.linear(h, mlp.fc1_weight, mlp.fc1_bias), approximate="tanh")
    reference = torch.nn.functional.linear(h, mlp.fc2_weight, mlp.fc2_bias)
    stats = te_on_cpu.stats()
    out["layernorm_mlp"] = {"fwd": stats["fp8_gemms_fwd"], "bwd": stats["fp8_gemms_bwd"], "hp": stats["non_fp8_gemms"],
                            "rel_err": float((y - reference).detach().norm() / reference.detach().norm())}
    # CUDA-as-CPU answers only TE's frames
    out["cuda_for_others"] = (torch.cuda.is_available(), torch.zeros(1).is_cuda)
    from transformer_engine.pytorch.utils import get_device_compute_capability

    out["te_capability"] = list(get_device_compute_capability())
    out["refusals"] = _gemm_refusals_on_hopper()
    return out


def _gemm_refusals_on_hopper() -> dict:
    """TE's refusals of issue 28 item 2 on the sm90 target, through tex with TE's own quantized tensors:
    mixed scaling modes (cublaslt_gemm.cu:107-111) and cuBLASLt's FP8 leading-dimension rule (:159-163)."""
    import torch
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer
    from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer, Float8Quantizer
    from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer

    from accel_fp8_fix.rehearsal.te_on_cpu import tex

    e4m3, f32 = tex.DType.kFloat8E4M3, tex.DType.kFloat32
    torch.manual_seed(3)

    def delayed(x):
        return tex.quantize(x, Float8Quantizer(torch.ones(1), torch.zeros(1), e4m3))

    def current(x):
        return tex.quantize(x, Float8CurrentScalingQuantizer(e4m3, torch.device("cpu")))

    def gemm(a, transa, b, transb):
        return tex.generic_gemm(a, transa, b, transb, None, None, f32, None, f32, False, None, False, None, 0,
                                False, False)

    w, x = torch.randn(64, 32), torch.randn(48, 32)
    mx = tex.quantize(w, MXFP8Quantizer(e4m3))
    block1d = tex.quantize(w, Float8BlockQuantizer(e4m3, rowwise=True, columnwise=True, block_scaling_dim=1))
    block2d = tex.quantize(x[:32], Float8BlockQuantizer(e4m3, rowwise=True, columnwise=True, block_scaling_dim=2))
    out = {
        "delayed_x_mxfp8": scenarios.runtime_error_of(lambda: gemm(mx, True, delayed(x), False)),
        "block1d_x_current": scenarios.runtime_error_of(lambda: gemm(block1d, True, current(x), False)),
        "bf16_x_mxfp8": scenarios.runtime_error_of(lambda: gemm(mx, True, x, False)),
        "block1d_x_block2d": scenarios.runtime_error_of(lambda: gemm(block1d, True, block2d, False)),  # allowed by TE
    }
    # wgrad (NT): lda = k = the token count; 24 tokens pass TE's Python check (a multiple of 8), not cuBLASLt's
    for tokens in (24, 32):
        xt, dy = torch.randn(tokens, 32), torch.randn(tokens, 48)
        for name, cast in (("delayed", delayed), ("current", current)):
            out[f"wgrad_{name}_{tokens}"] = scenarios.runtime_error_of(lambda: gemm(cast(xt), False, cast(dy), True))
    out["wgrad_bf16_24"] = scenarios.runtime_error_of(lambda: gemm(torch.randn(24, 32), False, torch.randn(24, 48), True))
    out["fprop_k24"] = scenarios.runtime_error_of(lambda: gemm(delayed(torch.randn(64, 24)), True, delayed(torch.randn(16, 24)), False))
    out["empty_wgrad"] = scenarios.runtime_error_of(lambda: gemm(delayed(torch.randn(0, 32)), False, delayed(torch.randn(0, 48)), True))
    # an empty per-tensor FP8 tensor given column-wise usage afterwards: TE's Python calls tex.fp8_transpose
    empty = {}
    for name, quantizer in (("delayed", Float8Quantizer(torch.ones(1), torch.zeros(1), e4m3)),
                            ("current", Float8CurrentScalingQuantizer(e4m3, torch.device("cpu")))):
        quantizer.set_usage(rowwise=True, columnwise=False)
        t = quantizer(torch.randn(5, 0))
        try:
            t.update_usage(rowwise_usage=True, columnwise_usage=True)
            empty[name] = list(t._transpose.shape)
        except RuntimeError as exc:
            empty[name] = str(exc)
    out["empty_columnwise"] = empty
    return out


@pytest.fixture(scope="module")
def with_te():
    (result,) = launcher.run(_with_te, 1, timeout=120)
    return result


def test_fp8_state_loads_without_the_unsafe_pickle_opt_in(with_te):
    assert with_te["unsafe_env"] is None  # never set, by the test nor by the package
    assert with_te["stock"].startswith("Refusing to load pickled Transformer Engine extra state for Linear")
    assert with_te["loaded_equal"]


def test_a_payload_te_never_writes_is_refused_with_tes_advisory_and_not_run(with_te):
    assert with_te["evil"].startswith("Refusing to load pickled Transformer Engine extra state for Linear")
    assert "refused global posix.system" in with_te["evil"]
    assert not with_te["evil_ran"]


def test_te_1x_bytesio_checkpoints_load(with_te):
    assert with_te["legacy_equal"]


def test_a_token_count_fp8_cannot_run_is_named_with_module_shape_and_remedy(with_te):
    assert with_te["shape_False"].startswith("FP8 execution requires")  # TE's own, no module named
    message = with_te["shape_True"]
    assert message.startswith("accel_fp8_fix: blocks.0.fc1 (Linear) got an input of shape [4, 32]")
    assert "pad_to_multiple_of=16" in message  # grad enabled on Hopper: the training rule (below)


def test_a_training_token_count_the_weight_gradient_gemm_cannot_run_is_named_before_te_refuses_it(with_te):
    """24 tokens a rank (8 mod 16) in training on Hopper: TE's forward runs, then its backward fails in the
    weight-gradient GEMM with cuBLASLt's rule and no module named. The check refuses it by name when the backward
    reaches the module; without a weight gradient (no grad, a frozen weight, a forward never run backward) 8 stays
    enough."""
    got = with_te["train24"]
    assert got["stock"] == "RuntimeError: Leading dimension requirement on A for FP8 GEMM. Caller must pad.", got
    assert got["checked"].startswith("ValueError: accel_fp8_fix: blocks.0.fc1 (Linear) got an input of shape [24, 32]")
    assert "a multiple of 16 (in training: the weight-gradient GEMM" in got["checked"]
    assert "pad_to_multiple_of=16" in got["checked"]
    assert got["no_grad"] is None and got["frozen"] is None and got["forward_only"] is None, got


def test_mixed_scaling_modes_are_refused_with_tes_message(with_te):
    """cublaslt_gemm.cu:107-111: A and B must share a scaling mode (FP8 block scaling 1-D with 2-D excepted);
    an unquantized tensor has NVTE_DELAYED_TENSOR_SCALING (its NoneQuantizer's mode)."""
    got = with_te["refusals"]
    want = ("Inputs A and B to GEMM need to have compatible scaling modes, but got A.scaling_mode = {}, "
            "B.scaling_mode = {}")
    assert got["delayed_x_mxfp8"] == want.format("NVTE_MXFP8_1D_SCALING", "NVTE_DELAYED_TENSOR_SCALING")
    assert got["block1d_x_current"] == want.format("NVTE_BLOCK_SCALING_1D", "NVTE_DELAYED_TENSOR_SCALING")
    assert got["bf16_x_mxfp8"] == want.format("NVTE_MXFP8_1D_SCALING", "NVTE_DELAYED_TENSOR_SCALING")
    assert got["block1d_x_block2d"] is None


def test_fp8_leading_dimension_rule_on_hopper(with_te):
    """cublaslt_gemm.cu:159-163: per-tensor FP8 A needs lda % 16 == 0; on sm90 lda = k (TN-only FP8), so a wgrad
    over 24 tokens is refused (delayed and current scaling alike), 32 tokens run, bf16 is not concerned, and an
    empty GEMM (never launched, gemm.cpp:303) is not checked."""
    got = with_te["refusals"]
    message = "Leading dimension requirement on A for FP8 GEMM. Caller must pad."
    assert got["wgrad_delayed_24"] == message and got["wgrad_current_24"] == message
    assert got["fprop_k24"] == message
    assert got["wgrad_delayed_32"] is None and got["wgrad_current_32"] is None
    assert got["wgrad_bf16_24"] is None and got["empty_wgrad"] is None


def test_an_empty_per_tensor_fp8_tensor_gets_an_empty_transpose(with_te):
    assert with_te["refusals"]["empty_columnwise"] == {"delayed": [0, 5], "current": [0, 5]}


def test_cuda_as_cpu_answers_only_tes_frames(with_te):
    assert list(with_te["cuda_for_others"]) == [False, False]  # accelerate / torch / user code still see a CPU
    assert with_te["te_capability"] == [9, 0]  # TE sees a Hopper


def test_current_scaling_and_layernorm_mlp_run_their_gemms_in_fp8(with_te):
    cs, mlp = with_te["current_scaling"], with_te["layernorm_mlp"]
    assert cs["fp8_gemms"] == 3 and cs["casts"] >= 3 and cs["rel_err"] < 0.1  # FP8 resolution vs fp32
    assert (mlp["fwd"], mlp["bwd"], mlp["hp"]) == (2, 4, 0) and mlp["rel_err"] < 0.1


# -- MXFP8: E8M0 block scales (common/util/ptx_arch_spec.cuh float_to_e8m0, ptx.cuh exp2f_rcp) -------------
def _reference_e8m0(value: float) -> int:
    """float_to_e8m0 rewritten on Python ints: the biased exponent of ``value``, rounded up, saturating."""
    import struct

    if math.isnan(value):
        return 0xFF
    if math.isinf(value):
        return 0xFE
    if value == 0.0:
        return 0
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    exponent, mantissa = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    if mantissa > 0 and exponent != 0xFE and not (exponent == 0 and mantissa <= 0x400000):
        exponent += 1
    return exponent


def test_e8m0_block_scale_rounds_the_exponent_up():
    values = [1.0, 1.5, 2.0, 3.0, 448.0 / 448.0, 0.75, 1e-3, 2.0 ** -126, 2.0 ** -130, 3e38, 0.0,
              float("inf"), float("nan")]
    got = tex.float_to_e8m0(torch.tensor(values, dtype=torch.float32)).tolist()
    assert got == [_reference_e8m0(float(torch.tensor(v, dtype=torch.float32))) for v in values]
    assert got[:4] == [127, 128, 128, 129]  # 1 -> 2**0; 1.5 and 2 -> 2**1; 3 -> 2**2


def test_mxfp8_blocks_scale_by_their_own_amax_and_round_trip():
    torch.manual_seed(0)
    x = torch.randn(64, 64)
    x[:32, :32] *= 1000.0  # one loud block: its scale must not leak into the others
    for columnwise in (False, True):
        bits, e = tex.mxfp8_quantize_2d(x, E4M3, columnwise)
        assert e.shape == ((2, 64) if columnwise else (64, 2))
        back = tex.mxfp8_dequantize_2d(bits, e, E4M3, columnwise)
        quiet = back[32:, 32:] - x[32:, 32:]
        assert float(quiet.abs().max()) < 0.25 and float((back - x).norm() / x.norm()) < 0.05
        # every block's largest magnitude lands at or below 448 after its power-of-two scale
        decoded = tex.fp8_bits_to_float(bits, E4M3)
        assert float(decoded.abs().max()) <= 448.0
    padded = tex._padded_scales(tex.mxfp8_quantize_2d(x, E4M3, False)[1], False, 64, 64)
    assert padded.shape == (128, 4)  # MXFP8Quantizer::get_scale_shape: roundup(M, 128) x roundup(K/32, 4)


# -- issue 28 item 2: an empty per-tensor FP8 transpose (transpose.cpp:43-46) ------------------------------------
@pytest.mark.parametrize("shape", [[5, 0], [0, 7], [2, 0, 3]])
def test_fp8_transpose_of_an_empty_tensor_is_empty(shape):
    """transpose.cpp fp8_transpose: the output [last, *rest] is allocated, then returned untouched when M or N is 0."""
    bits = torch.empty(shape, dtype=torch.uint8)
    want = [shape[-1], *shape[:-1]]
    assert list(tex.fp8_transpose(bits, E4M3).shape) == want
    out = torch.empty(want, dtype=torch.uint8)
    assert tex.fp8_transpose(bits, E4M3, out=out) is out
    assert list(tex._untranspose(torch.empty(want, dtype=torch.uint8)).shape) == shape


# -- issue 28 item 2: a strided plain operand, which TE's extension would misread --------------------------------
def _gemm(a, transa, b, transb, d=None):
    f32 = tex.DType.kFloat32
    return tex.generic_gemm(a, transa, b, transb, d, None, f32, None, f32, False, None, False, None, 0, False, False)


def test_a_strided_plain_operand_is_refused_naming_operand_and_strides():
    """TE's extension wraps a plain tensor by its data_ptr and sizes only (pytorch/csrc/common.cpp:134-146, its
    .contiguous() commented out), so cuBLAS would read a strided operand as row-major: another matrix. The
    rehearsal refuses it with its own message rather than compute the right answer."""
    torch.manual_seed(2)
    w, x = torch.randn(32, 32)[:, ::2], torch.randn(8, 16)  # w: [32, 16], strides (32, 2)
    with pytest.raises(RuntimeError, match=r"operand A: .*strides \(32, 2\).*CPU rehearsal") as refused:
        _gemm(w, True, x, False)
    assert "common.cpp" in str(refused.value) and "[32, 16]" in str(refused.value)
    with pytest.raises(RuntimeError, match=r"operand B: .*strides \(1, 8\)"):
        _gemm(w.contiguous(), True, torch.randn(16, 8).t(), False)
    with pytest.raises(RuntimeError, match=r"output D: .*strides \(1, 8\)"):
        _gemm(w.contiguous(), True, x, False, torch.empty(32, 8).t())
    got = _gemm(w.contiguous(), True, x, False)[0]  # contiguous: computed (all fp32: in TF32, as TE on the device)
    tf32 = tex.tf32_mode()
    assert torch.equal(got, tex.round_to_tf32(x, tf32) @ tex.round_to_tf32(w.contiguous(), tf32).t())


def test_grouped_gemm_inherits_the_strided_operand_refusal():
    empty = [torch.empty(0)] * 2
    w = [torch.randn(8, 16), torch.randn(16, 8).t()]
    x = [torch.randn(4, 16), torch.randn(6, 16)]
    with pytest.raises(RuntimeError, match=r"operand A: .*strides \(1, 8\)"):
        tex.te_general_grouped_gemm(w, True, x, False, None, tex.DType.kFloat32, [4, 6], empty, tex.DType.kFloat32,
                                    False, empty, False, empty, 0, False, False, 0)
