"""The stock failures of tests/distributed/test_stock_failures.py, re-run with the patch set active (ENV_FIXED):
the same scenarios, the same launches' plans, the assertions flipped."""

from __future__ import annotations

import pytest

from support import scenarios


ENV = scenarios.ENV_FIXED  # the environment of the launches ``two`` and ``four`` (tests/distributed/conftest.py)


def test_layers_fixes_on(two, four):
    for res in (*two, *four):
        assert res["_meta"] == {"fixes_active": True, "rehearsal_applied": True, "te_on_cpu": True}


def test_a1_tp_plus_te_prepares_and_runs_fp8(two):
    for f in scenarios.plan_facts(two, scenarios.PLAN_2RANK, "sc_a1_tp_te"):
        assert f["prepare_error"] is None
        assert f["fwd_stats"]["fp8_gemms_fwd"] == 14 and f["fwd_stats"]["non_fp8_gemms_fwd"] == 0
        assert f["loss"] == pytest.approx(f["reference_loss"], rel=0.05)  # FP8 + TP vs the fp32 model


def test_a2_fsdp2_plus_te_runs_fp8(two):
    for f in scenarios.plan_facts(two, scenarios.PLAN_2RANK, "sc_a2_fsdp2_te"):
        assert f["prepare_error"] is None and f["all_dtensor"]
        assert f["fwd_stats"]["fp8_gemms_fwd"] == 5 and f["fwd_stats"]["non_fp8_gemms_fwd"] == 0
        assert f["step_stats"]["fp8_gemms_bwd"] == 10 and f["step_stats"]["amax_reductions"] == 2


def test_a4_later_siblings_are_still_converted(two):
    for f in scenarios.plan_facts(two, scenarios.PLAN_2RANK, "sc_a4_convert_model"):
        assert f["odd"] == "torch.Linear"  # 64 -> 40 stays high precision
        assert f["first"] == f["after"] == f["nested.0"] == "transformer_engine.Linear"
        assert f["norm_after"] == "transformer_engine.LayerNorm"


@pytest.mark.parametrize("kind", ["buffer", "te"])
def test_a5_cpu_ram_efficient_loading_loads_every_entry(two, kind):
    for f in scenarios.plan_facts(two, scenarios.PLAN_2RANK, "sc_a5_ram_efficient", {"kind": kind}):
        assert f["prepare_error"] is None
        assert f["mismatched_after_load"] == []


def test_a10_fsdp2_x_tp_prepares_without_replicate_parallel(four):
    for f in scenarios.plan_facts(four, scenarios.PLAN_4RANK, "sc_mesh_2d"):
        assert f["prepare_error"] is None
        assert f["losses"] == pytest.approx(f["reference_losses"], rel=1e-4)  # mixed precision "no": exact math
        assert f["grad_norms"] == pytest.approx(f["reference_grad_norms"], rel=1e-4)  # clipped norm = one-process norm


@pytest.mark.parametrize("sizes", [{}, {"dp_shard": 4, "tp": 1}], ids=["fsdp2_x_tp", "fsdp2"])
def test_a18_model_sharded_at_load_by_transformers_prepares_and_trains_like_one_process(four, sizes):
    for f in scenarios.plan_facts(four, scenarios.PLAN_4RANK, "sc_a18_nd_loaded", sizes):
        assert f["prepare_error"] is None
        # transformers' sharding kept as loaded (the same parameters, on transformers' own meshes)
        assert f["all_dtensor"] and f["param_meshes"] == f["loaded"]["param_meshes"]
        assert f["placements"] == f["loaded"]["placements"] and f["fsdp_modules"] == f["loaded"]["fsdp_modules"]
        if not sizes:
            assert f["param_meshes"] == scenarios.ND_LOADED_MESHES
            assert f["placements"]["model.layers.0.self_attn.o_proj.weight"] == ["S(0)", "S(1)"]  # FSDP Shard(0), TP row Shard(1)
        assert f["losses"] == pytest.approx(f["reference_losses"], rel=1e-4)  # mixed precision "no": exact math
        assert f["grad_norms"] == pytest.approx(f["reference_grad_norms"], rel=1e-4)


def test_a6_full_state_dict_load_with_tp_sharded_params_is_correct(four):
    key = scenarios.key_of(scenarios.PLAN_4RANK, "sc_a6_tp_full_sd")
    for rank in range(4):
        f = four[rank][key]
        assert "scenario_error" not in f, f
        assert f["load_error"] is None and f["mismatched_local_shards"] == []
