"""Context parallelism on CPU (issue 31 items 1 and 3): the rehearsal's CPU ring attention (``rehearsal/context_parallel.py``)
puts the CPU flash-attention kernel into torch's CP handler table, so ``context_parallel`` runs torch's own ring on
gloo ranks. Before it, the first SDPA inside the context failed: "Operator
aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy registered".
CP attention must equal the same attention unsharded, forward and backward. With FP8 through the package (FSDP2
dp_shard 2 x cp 2, 4 ranks), CP's shape rules are refused by name when accelerate's ``maybe_context_parallel`` is
entered (A23, ``fixes/step/context_parallel.py``)."""

import pytest

from accel_fp8_fix.testing import DistributedTestError
from support import cp_scenarios
from support import launcher
from support import scenarios
from support import tolerances

PLAN = [
    ("sc_ring_attention", {"dtype": "float32", "causal": True, "load_balance": True}),
    ("sc_ring_attention", {"dtype": "float32", "causal": False, "load_balance": False}),
    ("sc_ring_attention", {"dtype": "bfloat16", "causal": True, "load_balance": True}),
    ("sc_ring_attention_refuses_a_mask", {}),
    ("sc_cp_exception_exits_the_dispatch", {}),
]


@pytest.fixture(scope="module")
def two():
    return scenarios.launch(cp_scenarios, PLAN, 2)


@pytest.mark.parametrize("entry", [0, 1, 2], ids=["fp32-causal-balanced", "fp32-full", "bf16-causal-balanced"])
def test_cp_attention_equals_unsharded_attention_forward_and_backward(two, entry):
    name, kwargs = PLAN[entry]
    bf16 = kwargs["dtype"] == "bfloat16"
    for f in scenarios.plan_facts(two, PLAN, name, kwargs):
        assert "scenario_error" not in f, f.get("scenario_error", "") + "\n" + "\n".join(f.get("traceback", []))
        assert f["installed"] and f["local_seq"] == cp_scenarios.SHAPE[2] // 2  # really sharded over 2 ranks
        # torch's ring called the CPU flash kernel per block, forward and backward
        assert f["ops"] == ["aten::_scaled_dot_product_flash_attention_for_cpu",
                            "aten::_scaled_dot_product_flash_attention_for_cpu_backward"], f["ops"]
        assert f["dtype"] == f"torch.{kwargs['dtype']}" and set(f["grad_dtypes"]) == {f"torch.{kwargs['dtype']}"}
        # fp32: the ring's log-sum-exp merge reorders the sums only; bf16: one bf16 rounding of each output
        # (2^-8 relative) on top of what the unsharded bf16 kernel rounds
        tolerance = 2 ** -7 * max(f["out_scale"], 1.0) if bf16 else 2e-6
        assert f["out_diff"] <= tolerance, (f["out_diff"], tolerance)
        assert max(f["grad_diffs"]) <= (2 * tolerance if bf16 else 1e-5), f["grad_diffs"]


def test_cp_attention_with_a_mask_is_refused_by_name(two):
    for f in scenarios.plan_facts(two, PLAN, "sc_ring_attention_refuses_a_mask"):
        assert f["error"] is not None and "accel_fp8_fix rehearsal: CPU ring attention with an attention mask" in \
            f["error"], f["error"]


TRAIN = [(family, layout) for family in ("llama", "qwen3") for layout in cp_scenarios.CP_LAYOUTS]
FP8_PLAN = [("sc_fsdp2_cp_fp8_shapes", {}), ("sc_cp_exception_exits_the_dispatch", {})] + [
    ("sc_cp_trains_like_one_process", {"family": family, "layout": layout}) for family, layout in TRAIN]


@pytest.fixture(scope="module")
def four_fp8_results():
    return scenarios.launch(cp_scenarios, FP8_PLAN, 4, env=scenarios.ENV_FIXED, timeout=900)


@pytest.fixture(scope="module")
def four_fp8(four_fp8_results):
    return scenarios.plan_facts(four_fp8_results, FP8_PLAN, "sc_fsdp2_cp_fp8_shapes")


def test_an_exception_inside_the_cp_context_leaves_sdpa_as_it_was(two, four_fp8_results):
    """torch 2.11 / 2.12's ``context_parallel`` turns CP's dispatch off after its ``yield``, with no ``finally``: an
    exception in a step (an OOM a script retries) left the ring's SDPA wrapper on for every later attention, CP or
    not. Stock (the 2-rank launch, rehearsal only) shows it there; with the package it is off on every torch."""
    from accel_fp8_fix.fixes.step.context_parallel import context_exits_on_error

    stock = scenarios.plan_facts(two, PLAN, "sc_cp_exception_exits_the_dispatch")
    fixed = scenarios.plan_facts(four_fp8_results, FP8_PLAN, "sc_cp_exception_exits_the_dispatch")
    for f in stock + fixed:
        assert "scenario_error" not in f, f.get("scenario_error", "") + "\n" + "\n".join(f.get("traceback", []))
        assert f["raised"] == "the step failed" and f["cleaned"]  # the user's exception, unchanged
    assert all(not f["fixes"] and f["left_on"] == (not context_exits_on_error()) for f in stock), stock
    assert all(f["fixes"] and not f["left_on"] and f["sdpa_restored"] for f in fixed), fixed


@pytest.mark.parametrize("family,layout", TRAIN, ids=[f"{f}-{l}" for f, l in TRAIN])
def test_cp_trains_like_one_process_and_its_checkpoints_resume_without_cp(four_fp8_results, family, layout):
    facts = scenarios.plan_facts(four_fp8_results, FP8_PLAN, "sc_cp_trains_like_one_process",
                                 {"family": family, "layout": layout})
    dp_shard, cp, tp = cp_scenarios.CP_LAYOUTS[layout]
    for f in facts:
        assert "scenario_error" not in f, f.get("scenario_error", "") + "\n" + "\n".join(f.get("traceback", []))
        names = ["dp_shard", "cp"] if dp_shard > 1 else ["cp", "tp"]
        assert f["mesh"]["dim_names"] == names and f["fp8_enabled"] and f["te_modules"] == f["converted"] == 14
        assert f["fp8_gemms_fwd"] == 14 * cp_scenarios.CP_STEPS  # every GEMM outside lm_head ran in FP8, each step
        assert all(f["fp8_state_identical"])  # the amax group spans the mesh, cp included
        ref, ref_norms = f["reference_losses"], f["reference_norms"]
        # step 0: the same weights and FP8 scales; the GEMMs see the same rows, split over ranks (TP also splits K)
        step0 = tolerances.step0_rel(1e-5, tp, f["row_parallel_ks"])
        assert f["losses"][0] == pytest.approx(ref[0], rel=step0)
        assert f["losses"] == pytest.approx(ref[:cp_scenarios.CP_STEPS], rel=1e-3)
        assert all(n > cp_scenarios.CP_CLIP for n in ref_norms)  # clipping acted at every step
        assert f["norms"] == pytest.approx(ref_norms[:cp_scenarios.CP_STEPS], rel=1e-2)
        # the loss README asks for (counted tokens over the global count) is what makes step 0 equal: the plain
        # per-rank mean of the same forward is off by far more (each shard counts different tokens)
        assert abs(f["unweighted_loss"] - ref[0]) > max(20 * abs(f["losses"][0] - ref[0]), 1e-5 * ref[0])
        # sharded checkpoints: every weight and FP8 state tensor bit for bit, into CP, without CP and back
        assert f["fp8_state_tensors"] == 56
        assert f["roundtrip_mismatch"] == f["no_cp_mismatch"] == f["back_mismatch"] == [[], []]
        assert f["no_cp_loss"] == pytest.approx(ref[cp_scenarios.CP_STEPS], rel=1e-3)
        assert f["no_cp_norm"] == pytest.approx(ref_norms[cp_scenarios.CP_STEPS], rel=1e-2)
        assert f["back_loss"] == pytest.approx(ref[cp_scenarios.CP_STEPS + 1], rel=1e-3)
        assert f["back_norm"] == pytest.approx(ref_norms[cp_scenarios.CP_STEPS + 1], rel=1e-2)
    assert len({(tuple(f["losses"]), tuple(f["norms"])) for f in facts}) == 1  # one value on every rank


def test_fsdp2_cp_fp8_trains_and_refuses_the_shapes_cp_cannot_cut_by_name(four_fp8):
    for f in four_fp8:
        assert "scenario_error" not in f, f.get("scenario_error", "") + "\n" + "\n".join(f.get("traceback", []))
        assert f["mesh"]["dim_names"] == ["dp_shard", "cp"] and f["fp8_enabled"] and f["te_modules"] == 14
        good, uneven, fp8_rule, balancer_off = f["cases"]
        assert good["error"] is None and good["warnings"] == [], "\n".join([str(good["error"])] + good.get("traceback", []))
        assert all(0 < loss < 10 for loss in good["losses"]) and len(good["norms"]) == 1
        assert uneven["error"].startswith("ValueError: accel_fp8_fix: maybe_context_parallel: buffer 0 (shape "
                                          "[2, 31]) has sequence length 31 on dim 1, not divisible by cp_size 2")
        assert "pad every sequence to a multiple of 32 (cp_size 2 x the FP8 token multiple 16" in uneven["error"]
        assert fp8_rule["error"].startswith("ValueError: accel_fp8_fix: maybe_context_parallel: buffer 0 (shape "
                                            "[1, 36]) leaves each CP rank 18 tokens"), fp8_rule["error"]
        if f["balancer_follows_length"]:  # torch >= 2.13: trains, unbalanced, with the warning below
            assert balancer_off["error"] is None and len(balancer_off["losses"]) == 1, balancer_off
        else:  # torch 2.11 / 2.12: its ring fails on such a length: refused by name instead
            assert balancer_off["error"].startswith("ValueError: accel_fp8_fix: maybe_context_parallel: sequence "
                                                    "length 34 is not a multiple of 2 x cp_size = 4"), balancer_off
    # the clipped norm is the mesh's: one value on every rank
    assert len({f["cases"][0]["norms"][0] for f in four_fp8}) == 1
    if four_fp8[0]["balancer_follows_length"]:
        rank0 = four_fp8[0]["cases"][3]["warnings"]  # warnings speak on rank 0
        assert any("sequence length 34 is not a multiple of 2 x cp_size = 4" in w for w in rank0), rank0


def test_the_audit_records_the_rings_collectives_alike_and_catches_a_planted_cp_divergence():
    records = launcher.run(cp_scenarios.cp_collectives, 2, env=scenarios.ENV_REHEARSAL, timeout=90)
    assert records[0] == records[1]  # counts, kinds, groups, dtypes and sizes (the splits are even here)
    kinds = {kind for kind, _group, _dtype, _numel in records[0]}
    assert any("all_gather" in kind for kind in kinds) and any("all_to_all" in kind for kind in kinds), kinds
    with pytest.raises(DistributedTestError) as info:
        launcher.run(cp_scenarios.cp_collectives, 2, args=(True,), env=scenarios.ENV_REHEARSAL, timeout=15)
    assert "differs between ranks 0 and 1" in str(info.value), str(info.value)[-3000:]
