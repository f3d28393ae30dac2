"""MoE experts packed as 3-D parameters on Transformer Engine grouped GEMMs (fixes/convert/moe_experts.py, issue 19):
one process, TE's real Python over the CPU kernel shim (a fresh process per recipe family: TE caches its
answers), Qwen3-MoE, Qwen2-MoE (shared expert) and GPT-OSS (issue 30: ``[E, in, out]`` weights with biases, gate
and up interleaved, a clamped SwiGLU) from transformers 5.x, tiny configs.

Numerics: with TE autocast off and the shim's TF32 off (``ACCEL_FP8_FIX_REHEARSAL_TF32=off``) the outputs and every gradient (input, routing weights, both 3-D parameters)
equal transformers' own eager loop bit for bit — same per-expert GEMM shapes, rows in transformers' order
(expert, then top-k slot, then token), the same ``index_add_`` order, zero-padding only under FP8.
transformers' default ``grouped_mm`` implementation sums the weight gradient in another order: its weight
gradients differ from the eager loop's by ~1e-7 relative (the outputs are identical). With FP8 on, the
grouped GEMM equals a ``te.Linear`` per expert bit for bit (current scaling: stateless, same quantization of
each expert's rows), and differs from fp32 by FP8's resolution (E4M3 forward, E5M2 gradients: ~6-10 % relative
in norm on these tiny random tensors).
"""

from __future__ import annotations

import pytest
import torch

from accel_fp8_fix.testing import training
from support import launcher
from support import moe_scenarios
from support import tolerances

GRAD_NAMES = ("out", "hidden", "weights", "gate_up_proj", "down_proj")
BIAS_NAMES = ("gate_up_proj_bias", "down_proj_bias")  # GPT-OSS
FAMILIES = moe_scenarios.UNIT_FAMILIES


def _names(family):
    return GRAD_NAMES + (BIAS_NAMES if family == "gpt_oss" else ())


@pytest.fixture(scope="module")
def facts():
    (result,) = launcher.run(moe_scenarios.sc_unit, 1, timeout=600)
    return result


@pytest.fixture(scope="module")
def mxfp8():
    (result,) = launcher.run(moe_scenarios.sc_mxfp8_padding, 1, env={"ACCEL_FP8_FIX_CPU_TE_ARCH": "sm100"}, timeout=600)
    return result


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case", ["experts", "zeros"])
def test_fp8_off_equals_transformers_own_loop_bit_for_bit(facts, family, case):
    f = facts[family][case]
    assert f["converted"] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"] and f["skipped"] == []
    assert sorted(f["fp8_off"]) == sorted(_names(family))  # every gradient of the experts module compared
    for name in _names(family):
        assert f["fp8_off"][name][0], (name, f["fp8_off"][name])
    # transformers' grouped_mm: the same outputs; weight gradients summed in another order (~1 ulp)
    for name in ("out", "hidden", "weights"):
        assert f["vs_grouped_mm_of_transformers"][name][0]
    for name in _names(family)[3:]:
        assert f["vs_grouped_mm_of_transformers"][name][2] < 1e-6
    # FP8 off: no padding, m_splits are the tokens per expert; every expert GEMM through TE's grouped GEMM
    assert f["fp8_off_splits"] == [("te_gate_up", f["counts"]), ("te_down", f["counts"])]
    hit = sum(1 for c in f["counts"] if c)
    assert f["fp8_off_stats"]["non_fp8_gemms"] == 2 * 3 * hit and f["fp8_off_stats"]["fp8_gemms"] == 0
    assert f["fp8_off_stats"]["grouped_gemms"] == 6  # forward, dgrad, wgrad of both projections


@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_off_in_tf32_as_on_the_device_is_within_tf32s_bound(facts, family):
    """TE runs its all-fp32 GEMMs in TF32 on the device (docs/rehearsal.md "TF32"); the shim does too unless told
    otherwise: the outputs two GEMMs deep, the gradients up to four (forward, dgrad, wgrad)."""
    for case in ("experts", "zeros"):
        f = facts[family][case]
        hit = sum(1 for c in f["counts"] if c)
        assert f["fp8_off_tf32_gemms"] == 2 * 3 * hit  # every expert GEMM of forward and backward in TF32
        for name in _names(family):
            gemms = 2 if name == "out" else 4
            equal, _, rel = f["fp8_off_tf32"][name]
            assert rel <= tolerances.tf32_rel(gemms), (case, name, rel, tolerances.tf32_rel(gemms))
        assert not f["fp8_off_tf32"]["out"][0]  # TF32 did round (the bit-for-bit check above runs with it off)


@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_on_is_fp8_and_close_to_fp32(facts, family):
    for case, kinds in (("experts", ("delayed", "current")), ("zeros", ("delayed",))):
        f = facts[family][case]
        hit = sum(1 for c in f["counts"] if c)
        for kind in kinds:
            stats = f[f"fp8_{kind}_stats"]
            assert (stats["fp8_gemms_fwd"], stats["fp8_gemms_bwd"], stats["non_fp8_gemms"]) == (2 * hit, 4 * hit, 0)
            for name in GRAD_NAMES:  # E4M3 / E5M2 resolution; a wrong expert or layout would be O(1)
                assert 1e-3 < f[f"fp8_{kind}"][name][2] < 0.15, (case, kind, name, f[f"fp8_{kind}"][name])
            if family == "gpt_oss":  # bias gradients: TE sums the high-precision output gradient; the gate_up
                # bias's passes through the FP8 down GEMM's dgrad, the down bias's through none
                assert 1e-3 < f[f"fp8_{kind}"]["gate_up_proj_bias"][2] < 0.15
                assert f[f"fp8_{kind}"]["down_proj_bias"][2] < 1e-6


@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_grouped_gemm_equals_a_te_linear_per_expert(facts, family):
    f = facts[family]["experts"]["fp8_current_vs_te_linear_loop"]
    for name in _names(family):
        assert f[name][0], (name, f[name])


@pytest.mark.parametrize("family", FAMILIES)
def test_te_gets_every_expert_weight_contiguous(facts, family):
    """TE's GEMMs read a weight's storage, not its strides (a transposed view reaching ``generic_gemm`` in a
    non-FP8 pass is silently wrong on a GPU; the CPU shim refuses it): GPT-OSS's ``[E, in, out]`` experts are
    handed over transposed and contiguous, the FP8-off pass above included."""
    count, contiguous = facts[family]["handed_weights_contiguous"]
    assert count > 0 and contiguous


@pytest.mark.parametrize("family", FAMILIES)
def test_m_splits_padded_to_16_under_fp8_with_empty_experts(facts, family):
    for case in ("experts", "zeros"):
        f = facts[family][case]
        padded = [-(-c // 16) * 16 for c in f["counts"]]
        assert f["fp8_delayed_splits"] == [("te_gate_up", padded), ("te_down", padded)]
    f = facts[family]["zeros"]
    assert f["counts"][3] == 0 and f["fp8_delayed_splits"][0][1][3] == 0


def test_mxfp8_pads_every_expert_to_32(mxfp8):
    padded = [-(-c // 32) * 32 for c in mxfp8["counts"]]
    assert mxfp8["counts"][2] == 0 and any(c % 32 for c in mxfp8["counts"])
    assert mxfp8["fp8_mxfp8_splits"] == [("te_gate_up", padded), ("te_down", padded)]
    assert mxfp8["fp8_mxfp8_stats"]["non_fp8_gemms"] == 0 and mxfp8["fp8_mxfp8_stats"]["fp8_gemms_fwd"] == 6
    for name in GRAD_NAMES:
        assert 1e-3 < mxfp8["fp8_mxfp8"][name][2] < 0.15, (name, mxfp8["fp8_mxfp8"][name])


@pytest.mark.parametrize("family", FAMILIES)
def test_whole_model_without_fp8_trains_like_transformers(facts, family):
    f = facts[family]["model"]
    assert f["loss_equal"]
    if family in ("qwen3_moe", "gpt_oss"):
        assert f["unequal_grads"] == []
    else:  # Qwen2-MoE: hidden_states also feed the shared expert and its gate, so autograd sums the input
        # gradient of 4 consumers instead of 7 (one per expert hit): a different association, ~1 ulp
        assert f["max_grad_rel_error"] < 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_state_dict_and_parameters_are_plain_transformers(facts, family):
    f = facts[family]["state_dict"]
    assert f["same_keys"] and f["same_shapes_dtypes"] and f["same_values"] and f["same_parameter_objects"]
    assert f["runner_params"] == 0
    assert all(k.endswith("._extra_state") for k in f["extra_keys"])
    assert {k for k in f["extra_keys"] if ".experts." in k} == {
        f"model.layers.{i}.mlp.experts.{r}._extra_state" for i in (0, 1) for r in ("te_gate_up", "te_down")}


@pytest.mark.parametrize("family", FAMILIES)
def test_coverage_counts_the_experts_and_names_the_router(facts, family):
    f = facts[family]["coverage"]
    assert f["fp8_param_share"] >= 0.9, f["summary"]
    kept = dict(f["high_precision"])
    routers = {f"model.layers.{i}.mlp.{'router' if family == 'gpt_oss' else 'gate'}" for i in (0, 1)}
    gates = {f"model.layers.{i}.mlp.shared_expert_gate" for i in (0, 1)} if family == "qwen2_moe" else set()
    assert set(kept) == routers | gates, kept
    for name in routers:
        assert kept[name].startswith("MoE router") and "by design" in kept[name]
    # FP8 state sized for E=4 GEMMs per grouped module (3 forward / 2 backward tensors per GEMM), at prepare
    assert f["meta_shapes"] == [[16, 12], [16, 8]] and f["meta_shapes_after_forward"] == [[16, 12]]


def _gpt_oss_experts():
    import transformers as tf

    config = tf.GptOssConfig(hidden_size=64, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                             num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, head_dim=16)
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    return GptOssExperts(config)


def test_unsupported_experts_are_kept_and_named():
    from torch import nn

    from accel_fp8_fix.fixes.convert.moe_experts import convert_experts

    model = nn.Module()
    model.no_gate, model.bad_bias = _gpt_oss_experts(), _gpt_oss_experts()
    model.no_gate.has_gate = False  # Nemotron-H's up_proj-only experts
    model.bad_bias.down_proj_bias = nn.Parameter(model.bad_bias.down_proj_bias[:, :16].detach())
    converted, skipped = convert_experts(model, te=None)
    assert converted == []
    reasons = dict(skipped)
    assert "no gate (up_proj only)" in reasons["no_gate"]
    assert "down_proj_bias [E, out] = [4, 64]" in reasons["bad_bias"]


def test_expert_parallel_and_odd_dims_are_refused_by_name():
    from torch import nn

    from accel_fp8_fix.fixes.convert.moe_experts import convert_experts

    model = training.zoo_model("qwen3_moe")
    model.model.layers[0].mlp.experts._is_expert_parallel = True
    converted, skipped = convert_experts(model, te=None, dim_multiple=128)
    reasons = dict(skipped)
    assert converted == [] and "expert parallelism" in reasons["model.layers.0.mlp.experts"]
    assert "multiples of 128" in reasons["model.layers.1.mlp.experts"]
    assert isinstance(model.model.layers[1].mlp.experts.gate_up_proj, nn.Parameter)


def test_expert_padding_is_tes_alignment_for_every_built_in_recipe(mxfp8):
    """issue 28: the package padded NVFP4 experts to 16 rows where TE aligns grouped quantized GEMMs to 128
    (``get_align_size_for_quantization``); now it asks TE, recipe by recipe."""
    multiples = mxfp8["row_multiples"]
    assert multiples == {"delayed": [16, 16], "current": [16, 16], "block": [16, 16], "mxfp8": [32, 32],
                         "nvfp4": [128, 128]}
