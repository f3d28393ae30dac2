"""Emulated TE modules: numerics, fp8_meta layout, checkpoints, construction (single process)."""

import pickle

import pytest
import torch

import accel_fp8_fix.emulation as emu
from accel_fp8_fix.emulation.te import pytorch as te
from accel_fp8_fix.emulation.te.common.recipe import (
    DelayedScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
)
from accel_fp8_fix.emulation.te.pytorch.quantization import (
    DelayedScalingRecipeState,
    FP8GlobalStateManager,
    _amax_and_scale_update,
)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(autouse=True)
def _clean_state():
    FP8GlobalStateManager.reset()
    emu.reset_stats()
    yield
    FP8GlobalStateManager.reset()


# ---- an independent reference: saturating cast to FP8, dequantize, fp32 matmul -------------------
def ref_qdq(x, scale, dtype):
    fmax = torch.finfo(dtype).max
    q = torch.clamp(x.float() * scale, -fmax, fmax).to(dtype)
    return q.float() * (1.0 / scale)


def make_linear(i=64, o=32, **kw):
    torch.manual_seed(0)
    return te.Linear(i, o, **kw)


def step(m, x, recipe, enabled=True):
    with te.autocast(enabled=enabled, recipe=recipe):
        y = m(x)
    y.float().pow(2).sum().backward()
    return y


def test_linear_delayed_scaling_matches_reference_bit_for_bit_and_is_not_fp32():
    m = make_linear()
    recipe = DelayedScaling(amax_history_len=4)
    x = torch.randn(16, 64) * 3
    step(m, x, recipe)  # step 1: scales 1 -> updated from the recorded amaxes at autocast exit
    s_fwd = m.fp8_meta["scaling_fwd"].scale.clone()
    s_bwd = m.fp8_meta["scaling_bwd"].scale.clone()
    amax_x = x.abs().max()
    assert s_fwd[0] == 448.0 / amax_x and s_fwd[1] == 448.0 / m.weight.detach().abs().max()
    assert s_bwd[0] != 1.0  # backward amaxes reduced/updated once per backward

    x2 = (torch.randn(16, 64) * 3).requires_grad_(True)
    with te.autocast(recipe=recipe):
        y = m(x2)
    x_dq = ref_qdq(x2.detach(), s_fwd[0], torch.float8_e4m3fn)
    w_dq = ref_qdq(m.weight.detach(), s_fwd[1], torch.float8_e4m3fn)
    ref = (x_dq @ w_dq.T).to(torch.float32) + m.bias.detach()
    assert torch.equal(y.detach(), ref)

    g = torch.randn_like(y)
    m.weight.grad = None
    y.backward(g)
    g_dq = ref_qdq(g, s_bwd[0], torch.float8_e5m2)  # HYBRID: grads in E5M2
    assert torch.equal(x2.grad, g_dq @ w_dq)
    assert torch.equal(m.weight.grad, g_dq.T @ x_dq)

    fp32 = x2.detach() @ m.weight.detach().T + m.bias.detach()
    assert not torch.equal(y.detach(), fp32), "FP8 silently off"
    rel = (y.detach() - fp32).norm() / fp32.norm()
    assert 1e-4 < rel < 0.06, rel


def test_current_scaling_and_mxfp8_numerics(monkeypatch):
    m = make_linear()
    x = torch.randn(8, 64)
    with te.autocast(recipe=Float8CurrentScaling()):
        y = m(x)
    sx = 448.0 / x.abs().max()
    sw = 448.0 / m.weight.detach().abs().max()
    ref = ref_qdq(x, sx, torch.float8_e4m3fn) @ ref_qdq(m.weight.detach(), sw, torch.float8_e4m3fn).T + m.bias.detach()
    assert torch.equal(y.detach(), ref)
    assert m.get_extra_state().numel() == 0  # stateless recipe
    assert not hasattr(m.fp8_meta["scaling_fwd"], "scale")

    with pytest.raises(RuntimeError, match="emulation on CPU"):
        with te.autocast(recipe=MXFP8BlockScaling()):
            pass
    monkeypatch.setenv("ACCEL_FP8_FIX_EMULATE_MXFP8", "1")
    m2 = make_linear()
    with te.autocast(recipe=MXFP8BlockScaling()):
        y2 = m2(x)
    fp32 = x @ m2.weight.detach().T + m2.bias.detach()
    assert not torch.equal(y2.detach(), fp32)
    assert ((y2.detach() - fp32).norm() / fp32.norm()) < 0.06


def test_without_autocast_or_disabled_is_plain_matmul():
    m = make_linear()
    x = torch.randn(8, 64, requires_grad=True)
    y = m(x)
    with te.autocast(enabled=False, recipe=DelayedScaling()):
        y2 = m(x)
    ref = torch.nn.functional.linear(x.detach(), m.weight.detach(), m.bias.detach())
    assert torch.allclose(y.detach(), ref, rtol=0, atol=1e-6) and torch.equal(y, y2)
    y.sum().backward()
    s = emu.stats()
    assert s["fp8_gemms"] == 0 and s["non_fp8_gemms"] == 4  # 2 forward + dgrad + wgrad
    assert m.non_fp8_gemm_count == 4 and m.fp8_gemm_count == 0
    assert m.fp8_meta == {"fp8_checkpoint": False, "fp8_group": None}
    assert m.get_extra_state().numel() == 0 and m.get_extra_state().dtype == torch.uint8


def test_scale_update_formula_on_hand_made_history():
    hist = torch.tensor([[0.0, 2.0, 0.0, float("inf")], [4.0, 1.0, 0.0, 1.0], [1.0, 8.0, 0.0, 1.0]])
    for algo in ("max", "most_recent"):
        for margin in (0, 2):
            recipe = DelayedScaling(margin=margin, amax_compute_algo=algo, amax_history_len=3)
            h, s = hist.clone(), torch.tensor([3.0, 3.0, 3.0, 3.0])
            _amax_and_scale_update(h, s, 448.0, recipe)
            amax = hist.max(0).values if algo == "max" else hist[0]
            exp = []
            for a in amax.tolist():
                if a == 0 or a == float("inf"):
                    exp.append(3.0)  # keep previous scale for zero / non-finite amax
                else:
                    exp.append((448.0 / a) / 2**margin)
            assert torch.equal(s, torch.tensor(exp)), (algo, margin, s, exp)
            # history rolled up by one, newest slot zeroed
            assert torch.equal(h, torch.cat([torch.zeros(1, 4), torch.roll(hist, -1, 0)[1:]]))
    h, s = torch.tensor([[1e-45]]), torch.tensor([1.0])
    _amax_and_scale_update(h, s, 448.0, DelayedScaling(amax_history_len=1))
    assert s.item() == torch.finfo(torch.float32).max  # tiny amax: infinite scale -> FP32_MAX


def test_fp8_meta_layout_and_recipe_defaults():
    r = DelayedScaling()
    assert (r.margin, r.fp8_format, r.amax_history_len, r.amax_compute_algo, r.reduce_amax) == (0, Format.HYBRID, 1024, "max", True)
    assert r.scaling_factor_compute_algo is None and not r.fp8_dpa and not r.fp8_mha
    assert r.delayed() and not r.mxfp8() and MXFP8BlockScaling().fp8_format == Format.E4M3
    m = make_linear()
    assert not isinstance(m, torch.nn.Linear) and isinstance(m, te.TransformerEngineBaseModule)
    assert m.fp8_meta == {"fp8_checkpoint": False, "fp8_group": None}
    assert list(m.state_dict()) == ["weight", "bias", "_extra_state"] and not list(m.buffers())
    for a in ("fp8", "fp8_initialized", "quantizers", "tp_group", "tp_size", "parallel_mode", "sequence_parallel",
              "fsdp_wrapped", "fsdp_group", "primary_weights_in_fp8", "activation_dtype"):
        assert hasattr(m, a), a
    assert m.quantizers == {"scaling_fwd": [], "scaling_bwd": []}
    step(m, torch.randn(4, 64, requires_grad=True), DelayedScaling(amax_history_len=8))
    meta = m.fp8_meta
    assert {"recipe", "fp8_group", "fp8_checkpoint", "num_gemms", "scaling_fwd", "scaling_bwd",
            "fp8_max_fwd", "fp8_max_bwd", "buffer_index_and_autocast_key"} <= set(meta)
    assert meta["fp8_checkpoint"] is True and meta["num_gemms"] == 1 and meta["fp8_group"] is None
    assert (meta["fp8_max_fwd"], meta["fp8_max_bwd"]) == (448, 57344)
    assert isinstance(meta["scaling_fwd"], DelayedScalingRecipeState)
    assert meta["scaling_fwd"].amax_history.shape == (8, 3) and meta["scaling_bwd"].amax_history.shape == (8, 2)
    assert meta["scaling_fwd"].scale.shape == (3,) and len(m.quantizers["scaling_fwd"]) == 3
    assert m.fp8 and m.fp8_initialized and m.fp8_gemm_count == 3


def test_eager_init_fp8_metadata():
    m = make_linear()
    m.emulation_init_fp8_state(DelayedScaling(amax_history_len=2))
    assert isinstance(m.fp8_meta["scaling_fwd"], DelayedScalingRecipeState)
    m2 = make_linear()
    with te.autocast(recipe=DelayedScaling(amax_history_len=2)):
        m2.init_fp8_metadata()
    assert m2.fp8_meta["scaling_bwd"].amax_history.shape == (2, 2)
    assert emu.stats()["scale_updates"] == 0


def test_extra_state_round_trip_is_bit_exact():
    m = make_linear()
    recipe = DelayedScaling(amax_history_len=5, margin=1)
    for _ in range(3):
        step(m, torch.randn(8, 64), recipe)
    sd = m.state_dict()
    es = sd["_extra_state"]
    assert es.dtype == torch.uint8 and es.numel() > 0
    state = pickle.loads(es.numpy().tobytes())
    assert {"recipe", "scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd", "extra_fp8_variables"} <= set(state)
    fresh = te.Linear(64, 32)
    fresh.load_state_dict(sd)
    for k in ("scaling_fwd", "scaling_bwd"):
        assert torch.equal(fresh.fp8_meta[k].scale, m.fp8_meta[k].scale)
        assert torch.equal(fresh.fp8_meta[k].amax_history, m.fp8_meta[k].amax_history)
    assert fresh.fp8_meta["recipe"] == recipe
    again = pickle.loads(fresh.get_extra_state().numpy().tobytes())
    assert again["extra_fp8_variables"] == state["extra_fp8_variables"] and again["recipe"] == state["recipe"]
    for k in ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd"):
        assert torch.equal(again[k], state[k])
    x = torch.randn(8, 64)
    with te.autocast(recipe=recipe):
        a, b = m(x), fresh(x)
    assert torch.equal(a, b)


def test_meta_device_construction_allocates_nothing_and_accepts_existing_params():
    lin = torch.nn.Linear(64, 32)
    m = te.Linear(64, 32, device="meta", params_dtype=torch.float32)
    assert m.weight.is_meta and m.bias.is_meta
    m.weight = lin.weight
    m.bias = lin.bias
    assert m.weight is lin.weight
    x = torch.randn(4, 64)
    assert torch.allclose(m(x), lin(x), atol=1e-6)
    m2 = te.Linear(64, 32, device="meta")
    m2.reset_parameters()
    assert not m2.weight.is_meta and torch.count_nonzero(m2.bias) == 0
    assert 0.015 < m2.weight.std().item() < 0.03  # TE's default init: normal(0, 0.023)


def test_constructor_signature_like_te():
    with pytest.raises(TypeError):
        te.Linear(64, 32, not_a_te_kwarg=True)
    with pytest.raises(TypeError):
        te.LayerNorm(64, not_a_te_kwarg=True)
    m = te.Linear(64, 32, bias=False, params_dtype=torch.bfloat16, init_method=torch.nn.init.ones_,
                  parallel_mode=None, sequence_parallel=False, tp_group=None, tp_size=1, return_bias=False)
    assert list(m.state_dict()) == ["weight", "_extra_state"] and m.weight.dtype == torch.bfloat16
    assert torch.equal(m.weight, torch.ones_like(m.weight))
    col = te.Linear(64, 32, tp_size=2, parallel_mode="column", device="meta")
    row = te.Linear(64, 32, tp_size=2, parallel_mode="row", device="meta")
    assert col.weight.shape == (16, 64) and row.weight.shape == (32, 32)
    assert (col.out_features, row.in_features) == (16, 32)
    out, b = te.Linear(8, 4, return_bias=True)(torch.randn(2, 8))
    assert b.shape == (4,)
    with pytest.raises(TypeError, match="Data types for parameters must match"):
        te.Linear(8, 4)(torch.randn(2, 8, dtype=torch.bfloat16))


def test_norms_and_layernorm_linear():
    ln = te.LayerNorm(64, eps=1e-6, params_dtype=torch.float32)
    assert sorted(n for n, _ in ln.named_parameters()) == ["bias", "weight"]
    x = torch.randn(4, 64)
    assert torch.allclose(ln(x), torch.nn.functional.layer_norm(x, (64,), eps=1e-6), atol=1e-6)
    rms = te.RMSNorm(64)
    assert [n for n, _ in rms.named_parameters()] == ["weight"]
    lnl = te.LayerNormLinear(64, 32)
    assert list(lnl.state_dict()) == ["layer_norm_weight", "layer_norm_bias", "weight", "bias", "_extra_state"]
    with te.autocast(recipe=DelayedScaling()):
        y = lnl(x)
    ref = torch.nn.functional.layer_norm(x, (64,)) @ lnl.weight.detach().T + lnl.bias.detach()
    assert y.shape == (4, 32) and not torch.equal(y, ref) and ((y - ref).norm() / ref.norm()) < 0.06
    assert lnl.fp8_gemm_count == 1


def test_bf16_under_torch_autocast_and_3d_inputs():
    m = make_linear(params_dtype=torch.bfloat16)
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16, requires_grad=True)
    with te.autocast(recipe=DelayedScaling()):
        y = m(x)
    assert y.shape == (2, 5, 32) and y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and m.weight.grad.dtype == torch.bfloat16


# ---- structure as real TE 2.20.2 (tests/test_real_te_structure.py checks it against a real build) ----
def test_norms_have_ops_extra_state_and_no_normalized_shape_attribute():
    for cls, keys in ((te.LayerNorm, ["weight", "bias", "_extra_state"]), (te.RMSNorm, ["weight", "_extra_state"])):
        m = cls(64, params_dtype=torch.float32)
        es = m.get_extra_state()
        assert es.dtype == torch.uint8 and es.numel() == 0 and es.device.type == "cpu"
        sd = m.state_dict()
        assert list(sd) == keys
        assert "normalized_shape" not in vars(m) and not hasattr(m, "normalized_shape")  # TE has none
        fresh = cls(64, params_dtype=torch.float32, device="meta").to_empty(device="cpu")
        fresh.load_state_dict(sd)  # strict: _extra_state is expected and accepted
        fresh.set_extra_state(None)
        fresh.set_extra_state(torch.frombuffer(bytearray(pickle.dumps({})), dtype=torch.uint8))
        with pytest.raises(RuntimeError, match="no quantizers"):
            fresh.set_extra_state(torch.frombuffer(bytearray(pickle.dumps({"forward": {}})), dtype=torch.uint8))
    ln = te.LayerNorm((4, 8), eps=1e-6)  # normalizes over the weight's shape
    x = torch.randn(3, 4, 8)
    assert torch.allclose(ln(x), torch.nn.functional.layer_norm(x, (4, 8), eps=1e-6), atol=1e-6)


def test_reset_parameters_sets_tensor_parallel_attributes_like_te():
    def attrs(p):
        return {k: getattr(p, k, None) for k in ("tensor_model_parallel", "partition_dim", "partition_stride")}

    for cls in (te.Linear, te.LayerNormLinear):
        plain = cls(64, 32)
        assert attrs(plain.weight) == {"tensor_model_parallel": True, "partition_dim": 0, "partition_stride": 1}
        assert attrs(plain.bias) == dict.fromkeys(attrs(plain.bias))  # bias: only for column mode
        col = cls(64, 32, tp_size=2, parallel_mode="column", device="cpu")
        assert attrs(col.weight) == attrs(col.bias) == {"tensor_model_parallel": True, "partition_dim": 0,
                                                        "partition_stride": 1}
        meta = cls(64, 32, device="meta")  # deferred init: nothing attached yet
        assert not hasattr(meta.weight, "tensor_model_parallel")
    row = te.Linear(64, 32, tp_size=2, parallel_mode="row", device="cpu")
    assert attrs(row.weight) == {"tensor_model_parallel": True, "partition_dim": 1, "partition_stride": 1}
    assert not hasattr(row.bias, "tensor_model_parallel") and row.bias.sequence_parallel is False
    row.reset_parameters()  # fresh Parameters each time: no "already has attribute" error
    assert row.weight.partition_dim == 1


def test_layernorm_linear_split_sizes_unfused_bias_add_and_default_layer_names():
    from accel_fp8_fix.emulation.te.debug.pytorch.debug_state import TEDebugState

    lnl = te.LayerNormLinear(64, 32)
    assert lnl.gemm_bias_unfused_add is False and lnl.parameter_split_sizes == [32]
    assert te.LayerNormLinear(64, 32, tp_size=2, parallel_mode="column", device="meta").parameter_split_sizes == [16]
    n = TEDebugState.layer_count
    assert [te.Linear(16, 16, device="meta").name, te.LayerNormLinear(16, 16, device="meta").name] == [
        f"Layer_{n}", f"Layer_{n + 1}"]
    assert te.Linear(16, 16, device="meta", name="mine").name == "mine" and TEDebugState.layer_count == n + 2
    te.LayerNorm(16, device="meta")  # op-based norms take no layer name
    assert TEDebugState.layer_count == n + 2
