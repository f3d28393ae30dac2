"""FSDP2 + TE FP8 through the patched ``Accelerator.prepare`` (CPU, gloo, Transformer Engine's real Python).

Each test reads facts of scenarios in tests/support/fp8_scenarios.py; one launch per world size runs them all.
The stock behaviour of the same setups is asserted in tests/distributed/test_stock_failures.py (A2: zero FP8 GEMMs).
"""

import re

import pytest

from support import fp8_scenarios
from support import scenarios

FROZEN = {"first Linear": ["blocks.0.norm", "blocks.0.fc1"],
          "first block and a norm": ["blocks.0.norm", "blocks.0.fc1", "blocks.0.fc2", "blocks.1.norm"]}
PLAN_2 = [
    ("sc_fsdp2_fp8_train", {}),
    *[("sc_fsdp2_fp8_train", {"frozen": frozen, "steps": 4}) for frozen in FROZEN.values()],
    ("sc_no_convertible_layer", {}),
    ("sc_optimizer_without_model", {}),
    ("sc_largest_allocation", {}),
    ("sc_fsdp2_fp8_train", {"steps": 2, "te_fsdp2_path": False}),  # mutation: TE's FSDP2 weight path off
    ("sc_equal_across_ranks_probe", {}),
]
PLAN_4 = [("sc_fsdp2_fp8_train", {"dp_replicate": 2, "dp_shard": 2, "steps": 4})]


def _facts(plan, world, name):
    results = scenarios.launch(fp8_scenarios, plan, world)
    return scenarios.facts_of(results, name)


@pytest.fixture(scope="module")
def train2():
    return _facts(PLAN_2, 2, "sc_fsdp2_fp8_train")


def test_the_fp8_state_comparison_across_ranks_tells_bits_dtypes_names_and_nan_apart():
    """The helper behind every "FP8 state identical across ranks" assertion exchanges digests, not tensors."""
    for f in _facts(PLAN_2, 2, "sc_equal_across_ranks_probe"):
        assert f == {"equal": True, "one_ulp": False, "nan": False, "dtype": False, "extra_name": False}


def test_conversion_happens_after_sharding_on_the_same_parameters(train2):
    for f in train2:
        assert f["converted"] == ["head", "blocks.0.norm", "blocks.0.fc1", "blocks.0.fc2", "blocks.1.norm",
                                  "blocks.1.fc1", "blocks.1.fc2"]
        assert f["skipped"] == []
        assert f["params_are_dtensors"] and f["optimizer_holds_model_params"]


def test_fp8_is_on_for_every_converted_layer_on_every_rank(train2):
    for f in train2:
        assert f["fp8_enabled"]
        fp8_scenarios.check_fp8_gemms(f)


def test_amax_reduction_is_one_collective_per_pass_on_the_mesh_group(train2):
    for f in train2:
        assert f["amax_group_ranks"] == f["mesh_ranks"] == [0, 1]
        assert f["fp8_group_is_amax_group"]
        # one forward reduction + one backward reduction per step, whatever the number of layers
        assert f["amax_reductions"] == 2 * fp8_scenarios.STEPS


def test_fp8_state_is_registered_as_buffers_and_identical_on_all_ranks_after_every_step(train2):
    for f in train2:
        assert f["registered"] == ["amax_history", "scale"]
        assert f["buffers_visible"]
        assert f["fp8_state_identical_every_step"] == [True] * fp8_scenarios.STEPS
        assert f["scales_moved"]  # delayed scaling really updated the scales


def test_losses_match_the_single_process_fp8_reference(train2):
    reference = train2[0]["reference"]
    for f in train2:
        fp8_scenarios.check_losses(f, reference)
    assert reference[-1] < 0.8 * reference[0]  # it trains


def test_clipped_grad_norm_is_the_single_process_norm(train2):
    """``accelerator.clip_grad_norm_`` on FSDP2's sharded gradients returns the whole model's norm as
    ``float()`` reads it (A17: torch 2.9 returned a Partial DTensor whose float() is one rank's share)."""
    for f in train2:
        fp8_scenarios.check_grad_norms(f)


def test_tes_fsdp2_weight_path_is_taken_and_the_checks_tell_a_run_without_it_apart(train2):
    """Every TE module takes TE's FSDP2 weight path (``is_fsdp2``, its cached FSDP2 state = its enclosing unit's),
    and the step-0 grad-norm check is tight enough to fail when that path is off on the ranks."""
    for f in train2:
        assert fp8_scenarios.LINEARS <= set(f["is_fsdp2"])
        assert all(f["is_fsdp2"].values()) and all(f["cached_state_is_enclosing_unit"].values())
    mutated = scenarios.facts_of(scenarios.launch(fp8_scenarios, PLAN_2, 2), scenarios.key_of(PLAN_2, "sc_fsdp2_fp8_train", {"steps": 2, "te_fsdp2_path": False}))
    for f in mutated:
        assert not any(f["is_fsdp2"].values())
        with pytest.raises(AssertionError):
            fp8_scenarios.check_grad_norms(f)
        rel = abs(f["grad_norms"][0] / f["reference_grad_norms"][0] - 1)
        assert rel > 2 * fp8_scenarios.STEP0_NORM_REL, rel  # well outside, not at the edge


def test_two_dim_data_parallel_mesh_flattens_into_one_amax_group():
    for f in _facts(PLAN_4, 4, "sc_fsdp2_fp8_train"):
        assert f["mesh_ranks"] == [0, 1, 2, 3]
        assert f["amax_group_ranks"] == [0, 1, 2, 3]
        assert f["fp8_group_is_amax_group"]  # TE got the mesh's flattened group, not None
        # the flattened dp_replicate x dp_shard group spans the world, so c10d hands back WORLD itself
        assert f["amax_groups"] in ([[0, 1, 2, 3]] * 8, ["WORLD"] * 8)
        assert f["fp8_state_identical_every_step"] == [True] * 4
        assert f["losses"][0] == pytest.approx(f["reference"][0], rel=1e-6)
        assert f["losses"] == pytest.approx(f["reference"], rel=1e-2)
        fp8_scenarios.check_grad_norms(f)  # HSDP: the norm is reduced over dp_replicate x dp_shard


def test_no_convertible_layer_warns_names_them_and_trains_in_high_precision():
    rank0, rank1 = _facts(PLAN_2, 2, "sc_no_convertible_layer")
    for f in (rank0, rank1):
        assert not f["fp8_enabled"] and f["loss_finite"]
        assert f["types"].count("Linear") == 2
    # one voice: rank 0 logs the kept layers once and warns once, at the caller's prepare() line
    assert len(rank0["logged"]) == 1 and "0: in_features=10, out_features=30" in rank0["logged"][0]
    assert len(rank0["warnings"]) == 1 and "FP8 stays OFF" in rank0["warnings"][0]
    assert rank0["warning_files"] == ["fp8_scenarios.py"]
    assert rank1["logged"] == [] and rank1["warnings"] == []


def test_optimizer_without_model_keeps_accelerates_own_error():
    # 1.13-1.15: "a model and optimizer must be passed together"; 1.16: "an optimizer must be passed together
    # with its model" (a model alone is accepted since 1.16)
    stock = re.compile(r"a model and optimizer must be passed together|an optimizer must be passed together with its model")
    for f in _facts(PLAN_2, 2, "sc_optimizer_without_model"):
        assert f["error"].startswith("ValueError: When using FSDP2") and stock.search(f["error"]), f["error"]


def test_conversion_after_sharding_never_allocates_a_full_size_weight():
    for f in _facts(PLAN_2, 2, "sc_largest_allocation"):
        full = f["patched"]["full_weight"]
        assert f["stock"]["largest"] >= full  # stock builds full-size TE weights before sharding
        assert f["patched"]["largest"] <= full // 2, f["patched"]


def test_checkpoint_saved_on_4_ranks_loads_on_2_bit_for_bit(tmp_path):
    saved = scenarios.launch(fp8_scenarios, [("sc_checkpoint_save", {"out_dir": str(tmp_path)})], 4)
    first = scenarios.facts_of(saved, "sc_checkpoint_save")[0]
    keys = first["keys"]
    assert any(k.endswith("_extra_state") for k in keys) and any(k.endswith("fc1.weight") for k in keys)
    # the export (get_state_dict's default unwrap=True, what save_model writes): every weight, no FP8 state
    assert first["export_keys"] == sorted(k for k in keys if not k.endswith("_extra_state"))
    plan = [("sc_checkpoint_load", {"out_dir": str(tmp_path)}),
            ("sc_checkpoint_load", {"out_dir": str(tmp_path), "recompute_entry": True}),
            ("sc_gradient_checkpointing_resume", {"out_dir": str(tmp_path)})]
    loaded = scenarios.launch(fp8_scenarios, plan, 2)
    # transformers' gradient checkpointing: saved at step 2 (TE's recompute entry in its pickles), resumed by a
    # fresh model of another init, ends where the uninterrupted run ends, bit for bit (issue 47 item 4)
    for f in scenarios.facts_of(loaded, "sc_gradient_checkpointing_resume"):
        assert f["first_losses"] == f["whole_losses"][:2] and f["resumed_losses"] == f["whole_losses"][2:]
        assert f["weights"] > 10 and f["unequal_weights"] == []
        assert f["fp8_states"] > 0 and f["fp8_nontrivial"] > 0 and f["unequal_fp8"] == []
    # a loading model whose TE pickles are longer than the checkpoint's (TE's recompute entry: gradient
    # checkpointing in the resumed run) loads the same state: the _extra_state buffers take the checkpoint's size
    for f in scenarios.plan_facts(loaded, plan, "sc_checkpoint_load", plan[1][1]):
        grown = f["extra_state_sizes"]
        assert len(grown) == 5 and all(after > before > 0 for before, after in grown.values()), grown
    for f in (scenarios.facts_of(loaded, "sc_checkpoint_load")
              + scenarios.plan_facts(loaded, plan, "sc_checkpoint_load", plan[1][1])):
        assert f["missing"] == [] and f["mismatched"] == []
        assert f["extra_state_keys"] == 7 and f["nonempty_extra_state"] == 5  # FP8 state of every TE Linear; +2 empty ones of the converted te.LayerNorms (TE's op-based norms have _extra_state)
        assert f["fp8_state_identical"]
        assert f["fp8_compared"] == 20 and f["fp8_mismatched"] == []  # scale + amax_history, fwd + bwd, 5 Linears
        assert f["fp8_nontrivial"] > 0  # the compared FP8 state is trained state, not initial values


# -- activation checkpointing under FP8 (A14): one launch, with and without checkpointing, fix on and off ----
PLAN_AC = [("sc_activation_checkpointing", {"how": h, "fix": fix}) for h, fix in (
    ("none", True), ("accelerate", True), ("accelerate", False),
    ("none-llama", True), ("transformers", True), ("transformers", False))]


@pytest.fixture(scope="module")
def ac():
    results = scenarios.launch(fp8_scenarios, PLAN_AC, 2)
    return {kw["how"] + ("" if kw["fix"] else "-stock"): scenarios.facts_of(results, scenarios.key_of(PLAN_AC, n, kw))
            for n, kw in PLAN_AC}


@pytest.mark.parametrize("how,baseline,routed,recomputed_gemms", [
    ("accelerate", "none", ["blocks.0", "blocks.1"], 4),  # FSDP2 plugin activation_checkpointing=True
    ("transformers", "none-llama", ["model", "model.layers.0", "model.layers.1"], 14),  # gradient_checkpointing_enable()
])
def test_activation_checkpointing_recomputes_in_fp8_with_the_same_losses(ac, how, baseline, routed, recomputed_gemms):
    for on, off in zip(ac[how], ac[baseline]):
        assert on["error"] is None and on["routed"] == routed
        assert on["losses"] == pytest.approx(off["losses"], rel=1e-6)  # the recompute reproduces the FP8 forward
        assert on["non_fp8_gemms"] == 0 and on["fp8_gemms_fwd"] == off["fp8_gemms_fwd"]
        # backward = dgrad + wgrad of every Linear + the recomputed forward GEMMs of the checkpointed layers
        assert on["fp8_gemms_bwd"] == off["fp8_gemms_bwd"] + recomputed_gemms * 3
        assert on["amax_groups"] == off["amax_groups"]


@pytest.mark.parametrize("how", ["accelerate", "transformers"])
def test_activation_checkpointing_without_the_fix_fails_on_the_recompute(ac, how):
    for f in ac[how + "-stock"]:
        # torch's checkpoint recomputes outside TE's autocast: high precision, other saved tensors
        assert f["error"].startswith("CheckpointError") and "Recomputed values" in f["error"]
        assert f["losses"] == []


@pytest.mark.parametrize("case,bwd_gemms_per_step", [("first Linear", 7), ("first block and a norm", 5)])
def test_frozen_first_layers_keep_one_backward_reduction_and_the_reference_losses(case, bwd_gemms_per_step):
    """PEFT-style frozen first layers change which TE module starts the backward amax reduction (TE lets a
    module do it only if something of it needs grad): still one reduction per pass on the mesh's group,
    identical state, and the losses of the same freezing in one process."""
    kwargs = {"frozen": FROZEN[case], "steps": 4}
    results = scenarios.launch(fp8_scenarios, PLAN_2, 2)
    for f in scenarios.facts_of(results, scenarios.key_of(PLAN_2, "sc_fsdp2_fp8_train", kwargs)):
        assert f["amax_reductions"] == 2 * 4 and f["fp8_state_identical_every_step"] == [True] * 4
        assert f["fp8_gemms_fwd"] == 5 * 4 and f["non_fp8_gemms"] == 0
        # frozen layers whose input needs no grad run neither dgrad nor wgrad
        assert f["fp8_gemms_bwd"] == bwd_gemms_per_step * 4
        fp8_scenarios.check_losses(f, f["reference"])
        fp8_scenarios.check_grad_norms(f)


def test_fsdp2_with_mxfp8_from_accelerates_recipe_kwargs():
    """MXFP8 (block scaling, stateless) through accelerate's TERecipeKwargs(use_mxfp8_block_scaling=True), on
    TE's Python answering as sm100: every GEMM in MXFP8, no amax collective, nothing pickled in the state
    dict, losses of the same recipe in one process."""
    results = scenarios.launch(fp8_scenarios, [("sc_fsdp2_mxfp8_train", {})], 2,
                       env={**scenarios.ENV_FIXED, "ACCEL_FP8_FIX_CPU_TE_ARCH": "sm100"})
    for f in scenarios.facts_of(results, "sc_fsdp2_mxfp8_train"):
        assert f["recipe"] == "MXFP8BlockScaling" and f["fp8_enabled"]
        # MXFP8 needs weight dims in multiples of 32: the 64 -> 16 head is kept, with the reason
        assert f["skipped"] == [["head", "in_features=64, out_features=16: TE's FP8 GEMMs need multiples of 32"]]
        assert (f["fp8_gemms_fwd"], f["fp8_gemms_bwd"], f["non_fp8_gemms"]) == (4 * 4, 8 * 4, 0)
        assert f["mxfp8_casts"] > 0 and f["amax_reductions"] == 0  # block scales are local
        assert f["extra_state_sizes"] == [0]  # stateless recipe: TE writes empty extra state
        assert f["losses"][0] == pytest.approx(f["reference"][0], rel=1e-6)
        assert f["losses"] == pytest.approx(f["reference"], rel=1e-2)


# -- one rank (tests/support/one_rank.py: one launch the test files share): single-GPU FSDP2, torch's world-size-1
# paths; the same assertions as on 2 ranks ----------------------------------------------------------------------
def test_one_rank_fsdp2_fp8_conversion_state_and_losses(one_rank):
    f = one_rank("fp8_scenarios", "sc_fsdp2_fp8_train")
    assert f["converted"] == ["head", "blocks.0.norm", "blocks.0.fc1", "blocks.0.fc2", "blocks.1.norm",
                              "blocks.1.fc1", "blocks.1.fc2"] and f["skipped"] == []
    assert f["params_are_dtensors"] and f["optimizer_holds_model_params"] and f["fp8_enabled"]
    assert f["amax_group_ranks"] == f["mesh_ranks"] == [0] and f["fp8_group_is_amax_group"]
    assert f["amax_reductions"] == 0  # TE reduces amaxes only over a group of more than one rank
    assert f["registered"] == ["amax_history", "scale"] and f["scales_moved"]
    assert all(f["is_fsdp2"].values()) and all(f["cached_state_is_enclosing_unit"].values())
    fp8_scenarios.check_fp8_gemms(f)
    fp8_scenarios.check_losses(f, f["reference"])
    fp8_scenarios.check_grad_norms(f)


def test_one_rank_checkpoint_round_trip_bit_for_bit(one_rank):
    saved = one_rank("fp8_scenarios", "sc_checkpoint_save", out_dir=one_rank.folder)
    keys = saved["keys"]
    assert any(k.endswith("_extra_state") for k in keys) and saved["export_keys"] == sorted(
        k for k in keys if not k.endswith("_extra_state"))
    f = one_rank("fp8_scenarios", "sc_checkpoint_load", out_dir=one_rank.folder)
    assert f["missing"] == [] and f["mismatched"] == []
    assert f["extra_state_keys"] == 7 and f["nonempty_extra_state"] == 5
    assert f["fp8_compared"] == 20 and f["fp8_mismatched"] == [] and f["fp8_nontrivial"] > 0


@pytest.mark.parametrize("how,baseline,routed,recomputed_gemms", [
    ("accelerate", "none", ["blocks.0", "blocks.1"], 4),
    ("transformers", "none-llama", ["model", "model.layers.0", "model.layers.1"], 14),
])
def test_one_rank_activation_checkpointing_recomputes_in_fp8(one_rank, how, baseline, routed, recomputed_gemms):
    on = one_rank("fp8_scenarios", "sc_activation_checkpointing", how=how)
    off = one_rank("fp8_scenarios", "sc_activation_checkpointing", how=baseline)
    assert on["error"] is None and on["routed"] == routed
    assert on["losses"] == pytest.approx(off["losses"], rel=1e-6)
    assert on["non_fp8_gemms"] == 0 and on["fp8_gemms_fwd"] == off["fp8_gemms_fwd"]
    assert on["fp8_gemms_bwd"] == off["fp8_gemms_bwd"] + recomputed_gemms * 3
    assert on["amax_groups"] == off["amax_groups"]
