"""Stock accelerate failures, reproduced on CPU ranks: ACCEL_FP8_FIX=0 (no fixes) + TE's real Python on CPU + rehearsal.

These are the "before" of the fixes: each scenario lives in tests/support/scenarios.py and returns facts, so the
same scenario re-run with ENV_FIXED flips these assertions. The launches are shared with test_rehearsal.py
(PLAN_2RANK on 2 ranks, PLAN_4RANK on 4 ranks; memoised per pytest process).
"""

from __future__ import annotations

import pytest

from support import scenarios
from support import versions


ENV = scenarios.ENV_REHEARSAL  # the environment of the launches ``two`` and ``four`` (tests/distributed/conftest.py)


def test_stock_layers(two, four):
    for res in (*two, *four):
        assert res["_meta"] == {"fixes_active": False, "rehearsal_applied": True, "te_on_cpu": True}


def test_a1_tp_plus_te_prepare_raises_mixed_tensor_dtensor(two):
    for f in scenarios.plan_facts(two, scenarios.PLAN_2RANK, "sc_a1_tp_te"):
        assert f["distributed_type"] == "MULTI_GPU" and f["mixed_precision"] == "fp8"
        assert f["mesh"] == {"device_type": "cpu", "dim_names": ["tp"], "shape": [2]}
        # torch's message matched by meaning (its wording changed across releases: 2.9 and 2.13 differ):
        # a RuntimeError from DTensor dispatch of aten.copy_ that names the mixed Tensor / DTensor operands
        error = f["prepare_error"]
        assert error.startswith("RuntimeError: ") and "aten.copy_" in error, error
        assert "mixed torch.Tensor and DTensor" in error, error
        # ... raised where docs/failures.md (A1) says: convert_model's te_module.weight.copy_(module.weight)
        assert "te_module.weight.copy_(module.weight)" in "\n".join(f["traceback_tail"])


def test_a2_fsdp2_plus_te_runs_without_fp8(two):
    for f in scenarios.plan_facts(two, scenarios.PLAN_2RANK, "sc_a2_fsdp2_te"):
        assert f["distributed_type"] == "FSDP" and f["is_fsdp2"] and f["mixed_precision"] == "fp8"
        assert f["prepare_error"] is None and f["all_dtensor"]
        assert f["te_modules"] == 7  # convert_model did run: 5 te.Linear + 2 te.LayerNorm
        fwd = f["fwd_stats"]
        assert fwd["fp8_gemms_fwd"] == 0 and fwd["non_fp8_gemms_fwd"] == 5  # every GEMM in high precision
        assert f["step_stats"]["fp8_gemms"] == 0 and f["step_stats"]["amax_reductions"] == 0


def test_a4_convert_model_stops_at_a_non_divisible_linear(two):
    for f in scenarios.plan_facts(two, scenarios.PLAN_2RANK, "sc_a4_convert_model"):
        assert f["first"] == "transformer_engine.Linear"  # converted
        assert f["odd"] == "torch.Linear"  # 64 -> 40: skipped, correctly
        # ... but `return` instead of `continue`: every later sibling is left unconverted
        assert f["after"] == "torch.Linear" and f["norm_after"] == "torch.LayerNorm"
        assert f["nested"] == "torch.Sequential" and f["nested.0"] == "torch.Linear"


@pytest.mark.parametrize("kind", ["buffer", "te"])
def test_a5_cpu_ram_efficient_loading_plain_state_dict_entries(two, kind):
    """1.13-1.15 read ``.device_mesh`` of every entry; 1.16 broadcasts plain tensors whole (a buffer loads) but
    still asks the module for ``_extra_state`` as an attribute (TE modules fail)."""
    new = versions.accelerate_at_least("1.16")
    for f in scenarios.plan_facts(two, scenarios.PLAN_2RANK, "sc_a5_ram_efficient", {"kind": kind}):
        assert f["distributed_type"] == "FSDP" and f["is_fsdp2"]
        if new and kind == "buffer":
            assert f["prepare_error"] is None and f["mismatched_after_load"] == [], f
            continue
        if new:
            assert f["prepare_error"] == "AttributeError: 'LayerNorm' object has no attribute '_extra_state'"
        else:
            assert f["prepare_error"] == "AttributeError: 'Tensor' object has no attribute 'device_mesh'"
        if kind == "buffer":
            assert f["plain_state_dict_entries"] == ["scale"]
        else:
            assert f["mixed_precision"] == "fp8"
            assert f["plain_state_dict_entries"] and all(k.endswith("._extra_state") for k in f["plain_state_dict_entries"])


def test_a10_fsdp2_x_tp_replicate_parallel_import(four):
    for f in scenarios.plan_facts(four, scenarios.PLAN_4RANK, "sc_mesh_2d"):
        assert f["distributed_type"] == "FSDP" and f["mesh"]["dim_names"] == ["dp_shard", "tp"]
        assert f["prepare_error"].startswith(
            "ImportError: cannot import name 'ReplicateParallel' from 'transformers.integrations.tensor_parallel'"
        )


def test_a18_model_sharded_at_load_by_transformers_fails_in_prepare(four):
    """N-D loading the supported way of transformers 5.x (DistributedConfig: TP and/or FSDP2 applied at load),
    then accelerate's prepare with the same sizes — in plain fp32, no TE involved. FSDP2 x TP stops at A10 first;
    FSDP2 alone shows A18: stock resolves the auto-wrap policy on a model whose layer classes are FSDP
    subclasses by then (fsdp2_prepare_model would have left the model as it is)."""
    for f in scenarios.plan_facts(four, scenarios.PLAN_4RANK, "sc_a18_nd_loaded", {}):
        loaded = f["loaded"]
        assert loaded["all_dtensor"] and loaded["param_meshes"] == scenarios.ND_LOADED_MESHES
        assert loaded["model_type"] == "FSDPLlamaForCausalLM"
        assert f["prepare_error"].startswith("ImportError: cannot import name 'ReplicateParallel'")  # A10
    for f in scenarios.plan_facts(four, scenarios.PLAN_4RANK, "sc_a18_nd_loaded", {"dp_shard": 4, "tp": 1}):
        assert f["loaded"]["model_type"] == "FSDPLlamaForCausalLM" and f["loaded"]["all_dtensor"]
        assert f["prepare_error"] == "ValueError: Could not find the transformer layer class LlamaDecoderLayer in the model."


def test_a6_full_state_dict_load_with_tp_sharded_params(four):
    """Rank 0 broadcasts its *local* TP shard, the other ranks receive into global-shape buffers (gloo does
    not notice); rank 0 then fails in load_state_dict with a size mismatch, the others load wrong values."""
    facts = four
    key = scenarios.key_of(scenarios.PLAN_4RANK, "sc_a6_tp_full_sd")
    rank0 = facts[0][key]
    assert "scenario_error" not in rank0, rank0
    assert rank0["shard_error"] is None
    assert rank0["fsdp_mesh"] == {"device_type": "cpu", "dim_names": ["dp_shard_cp"], "shape": [2]}
    assert rank0["load_error"].startswith("RuntimeError: Error(s) in loading state_dict for FSDPLlamaForCausalLM")
    assert "size mismatch for model.layers.0.self_attn.q_proj.weight: copying a param with shape torch.Size([32, 64])" in rank0["load_error"]
    for rank in (1, 2, 3):
        f = facts[rank][key]
        assert "scenario_error" not in f, f
        # No error on these ranks: the mismatch is silent, the loaded TP-sharded weights are wrong.
        assert f["load_error"] is None
        assert "model.layers.0.self_attn.q_proj.weight" in f["mismatched_local_shards"]
