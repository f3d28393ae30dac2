"""Diagnostics on real gloo ranks, TE's real Python on CPU: audit of the demo model, error notes where the
DTensor errors happen (fixes on, and stock accelerate inside ``explain_errors``), stock FSDP2 + FP8 audited
(FP8 off, A2), public collectives.

Two launches (tests/support/diagnostics_scenarios.py): 4 ranks with the fixes on and ACCEL_FP8_FIX_AUDIT=1, 2 ranks
on stock accelerate.
"""

from __future__ import annotations

import pytest

from support import diagnostics_scenarios
from support import scenarios

LINEARS = {f"model.layers.{i}.{p}" for i in range(2) for p in (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
USER_FIX = "use accel_fp8_fix.distributed collectives with the mesh"


@pytest.fixture(scope="module")
def fixed():
    return scenarios.launch(diagnostics_scenarios, diagnostics_scenarios.PLAN_FIXED_4, 4,
                            env={**scenarios.ENV_FIXED, "ACCEL_FP8_FIX_AUDIT": "1"})


@pytest.fixture(scope="module")
def stock():
    return scenarios.launch(diagnostics_scenarios, diagnostics_scenarios.PLAN_STOCK_2, 2,
                            env=scenarios.ENV_REHEARSAL)


def _same_error_with_a_note(noted, direct, note_has):
    """The noted error is the stock one: same type, same message, same innermost frame; one note added."""
    assert noted is not None and direct is not None
    assert noted["type"] == direct["type"] and noted["str"] == direct["str"]
    assert noted["innermost"] == direct["innermost"]
    assert len(noted["notes"]) == 1 and not direct["notes"]
    for needle in note_has:
        assert needle in noted["notes"][0], noted["notes"][0]


def test_audit_of_the_demo_model_reports_the_expected_counts(fixed):
    for rank, f in enumerate(scenarios.facts_of(fixed, "sc_demo_audit")):
        assert set(f["fp8_modules"]) == LINEARS and set(f["native_tp"]) == LINEARS
        assert [n for n, _ in f["kept"]] == ["lm_head"] and "FSDP2 unit of its own" in f["kept"][0][1]
        assert f["amax_group_ranks"] == [0, 1, 2, 3]
        assert f["stray"] == [] and f["mixed"] == [] and f["tp_mismatches"] == []
        assert f["summary"].startswith("14 Linear in FP8 with TE-native TP, 1 kept: lm_head \u2014 its own FSDP2 unit; "
                                       "amax group 4 ranks; 0 stray tensors; 0 mixed modules")
        q = f["q_proj"]
        assert q["fsdp_unit"] == "model.layers.0" and q["parallel_mode"] == "column" and q["fp8_state"] == 4
        assert q["params"] == [("model.layers.0.self_attn.q_proj.weight", "DTensor", ("dp_shard_cp", "tp"),
                                ("_S(0, 2)", "S(0)"))]
        assert f["lm_head_unit"] == "lm_head"
        # ACCEL_FP8_FIX_AUDIT=1: printed after prepare by the mesh's first rank only
        assert ("accel_fp8_fix audit: " + f["summary"] in f["printed"]) == (rank == 0)


def test_fp8_coverage_is_the_share_of_gemm_weights_and_matches_the_gemms_te_ran(fixed):
    for f in scenarios.facts_of(fixed, "sc_demo_audit"):
        c = f["coverage"]
        assert c["fp8_param_share"] == pytest.approx(f["expected_param_share"])
        assert c["fp8_gemms_per_step"] == f["measured_fp8_gemms"]  # forward + dgrad + wgrad TE really ran in FP8
        assert c["gemms_per_step"] == 3 * f["linears"]
        assert c["fp8_gemm_share"] == pytest.approx(c["fp8_gemms_per_step"] / c["gemms_per_step"])
        assert [n for n, _ in c["high_precision"]] == ["lm_head"] and f["measured_high_precision_te_gemms"] == 0


def test_planted_stray_state_and_mixed_module_are_named(fixed):
    for f in scenarios.facts_of(fixed, "sc_demo_audit"):
        assert f["stray_planted"] == ["model.layers.0.self_attn.q_proj.fp8_meta.planted_amax"]
        assert f["mixed_planted"] == ["gain"]
        e = f["mixed_error"]
        assert e["type"] == "RuntimeError" and "got mixed torch.Tensor and DTensor" in e["str"]
        note = e["notes"][0]
        assert "(forward)" in note and "module gain (Gain; weight: DTensor [Replicate()], scale: plain)" in note
        assert "modules mixing DTensor and plain tensors: gain" in note and "diagnostics_scenarios.py" in note


def test_user_hooks_handing_a_dtensor_to_c10d_get_a_note_naming_the_parameter_and_the_fix(fixed):
    for f in scenarios.facts_of(fixed, "sc_user_hook_errors"):
        assert f["weight_is_dtensor"]
        assert any(s in f["direct"]["str"] for s in diagnostics_scenarios.SEED_ERRORS)
        for where, key in (("forward", "forward"), ("optimizer.step", "step"), ("Accelerator.backward", "backward")):
            _same_error_with_a_note(f[key], f["direct"], (
                f"({where})", "parameter model.layers.0.self_attn.q_proj.weight", "your own code",
                "diagnostics_scenarios.py", "in _user_broadcast", USER_FIX))
        # the forward note is added from torch's own except block: no frame of this package in the traceback
        assert not any(name == "notes.py" for name, _ in f["forward"]["frames"])


def test_stock_accelerate_a1_error_explained_naming_the_module(stock):
    for f in scenarios.facts_of(stock, "sc_stock_errors_explained"):
        assert f["fixes_active"] is False
        e = f["a1"]
        # torch's own message, matched by meaning (2.9 words it "aten.copy_.default: got mixed ...")
        assert e["type"] == "RuntimeError" and e["str"].startswith("aten.copy_.default"), e["str"]
        assert "mixed torch.Tensor and DTensor" in e["str"], e["str"]
        assert ("transformer_engine.py", "convert_model") in e["frames"]  # raised where stock raises it
        note = e["notes"][0]
        assert "module model.layers.0.self_attn.q_proj (Linear; weight: DTensor [Shard(dim=0)])" in note
        assert "activate accel_fp8_fix" in note and "your own code" not in note  # accelerate's frame, not the user's


def test_stock_user_broadcast_and_mixture_explained(stock):
    for f in scenarios.facts_of(stock, "sc_stock_errors_explained"):
        _same_error_with_a_note(f["user"], f["direct"], ("DTensor argument 'tensor' (4,) [Replicate()]",
                                                          "in _user_broadcast", USER_FIX))
        assert "got mixed torch.Tensor and DTensor" in f["mixture"]["str"] and "in mixture" in f["mixture"]["notes"][0]


def test_audit_of_stock_fsdp2_fp8_says_fp8_is_off_and_why(stock):
    for f in scenarios.facts_of(stock, "sc_stock_a2_audit"):
        assert f["measured_fp8_gemms"] == 0  # A2 for real: TE modules, no FP8 GEMM
        assert f["te_modules"] == 7 and f["fp8_modules"] == [] and not f["fixes_prepared"]
        assert f["summary"].startswith("FP8 OFF: 7 Transformer Engine module(s), none runs FP8")
        assert set(f["why_not"]) == {"head", "blocks.0.fc1", "blocks.0.fc2", "blocks.1.fc1", "blocks.1.fc2"}
        assert all("does not run under Transformer Engine's autocast" in w and "A2" in w for w in f["why_not"].values())
        share, gemm_share, high = f["coverage"]
        assert share == 0.0 and gemm_share == 0.0 and set(high) == set(f["why_not"])


@pytest.mark.parametrize("launch_name", ["fixed", "stock"])
def test_public_collectives_equal_the_reference_on_every_rank(launch_name, request):
    results = request.getfixturevalue(launch_name)
    for rank, f in enumerate(scenarios.facts_of(results, "sc_public_collectives")):
        for op in ("broadcast", "all_reduce", "all_gather"):
            assert f[op] and all(f[op].values()), (op, f[op])
        assert len(f["broadcast"]) == (4 if launch_name == "fixed" else 3)
        assert f["dtensor_calls"] == 0  # the collective spy: no DTensor reached c10d
        row = [rank - rank % 2, rank - rank % 2 + 1]  # the ranks of this rank's last mesh dim, in order
        assert f["plain_all_gather"] == [[float(r)] * 2 for r in row]
        assert "not promoted to a DTensor" in f["refused"]["plain_without_mesh"]
        assert "a shard is not a replica" in f["refused"]["sharded_dim"]
    if launch_name == "fixed":
        facts = scenarios.facts_of(results, "sc_public_collectives")
        assert all(f["plain_all_reduce"] == [6.0, 6.0] for f in facts)  # 0+1+2+3 over the whole 2x2 mesh
        assert {(0, 1), (1, 3)} <= set(facts[1]["groups"])  # rank 1: its 'tp' row and its 'dp' column
