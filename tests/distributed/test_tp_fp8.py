"""TP and FSDP2 x TP + TE FP8 through the patched ``Accelerator.prepare`` (CPU, gloo, Transformer Engine's real Python).

A tiny transformers Llama is TP-sharded the way transformers 5.x shards it; Linears become TE modules
configured for TE's own TP on the same DTensor Parameter objects. Stock behaviour (A1 mixed-type crash,
A10 ImportError) is asserted in tests/distributed/test_stock_failures.py.
"""

import re

import pytest

from support import scenarios
from support import tolerances
from support import tp_scenarios

TP_LINEARS = {f"model.layers.{i}.{p}" for i in range(2) for p in (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}


TWO_RANK_PLAN = [("sc_tp_fp8_train", {}), ("sc_tp_heads_misfit", {})]


@pytest.fixture(scope="module")
def two_ranks():
    return scenarios.launch(tp_scenarios, TWO_RANK_PLAN, 2)


@pytest.fixture(scope="module")
def tp2(two_ranks):
    return scenarios.facts_of(two_ranks, "sc_tp_fp8_train")


def test_kv_heads_not_divisible_by_tp_size_is_a_named_error_at_prepare(two_ranks):
    """Before: prepare passed and the first forward failed with a bare ``shape '[4, 16, -1, 16]' is invalid for input of size 512``."""
    for f in scenarios.facts_of(two_ranks, "sc_tp_heads_misfit"):
        assert f["where"] == "prepare", f
        assert f["error"].startswith("ValueError: accel_fp8_fix: tensor parallelism splits the attention heads")
        assert "num_key_value_heads=1 is not a multiple of tp_size=2" in f["error"]
        assert "num_attention_heads=4, num_key_value_heads=1" in f["error"] and "LlamaConfig" in f["error"]


MISFIT = {"dp_shard": 2, "tp": 2, "intermediate": 48, "steps": 3}  # MLP 48 fits FP8 globally, 24 per TP rank does not
FOUR_RANK_PLAN = [("sc_tp_fp8_train", {"dp_shard": 2, "tp": 2}), ("sc_tp_fp8_train", MISFIT)]


@pytest.fixture(scope="module")
def four_ranks(ckpt_dir):
    """One 4-rank launch: FSDP2 x TP training (plus the locally misfit MLP), then a 2x2 checkpoint save."""
    return scenarios.launch(tp_scenarios, [*FOUR_RANK_PLAN, ("sc_tp_checkpoint_save", {"out_dir": ckpt_dir})], 4)


@pytest.fixture(scope="module")
def fsdp_tp(four_ranks):
    return scenarios.facts_of(four_ranks, "sc_tp_fp8_train")


def _check_conversion(f):
    assert set(f["converted"]) == TP_LINEARS
    # lm_head is colwise_gather_output (no TE equivalent: it keeps transformers' TP); under FSDP2 it is
    # also its own FSDP unit, which is checked first
    assert f["skipped"] == ["lm_head"]
    assert ("it is the model's output layer" in f["skip_reasons"][0]
            or "FSDP2 unit of its own" in f["skip_reasons"][0])
    modes = f["parallel_modes"]
    assert {modes[n] for n in TP_LINEARS if n.endswith(("o_proj", "down_proj"))} == {"row"}
    assert {modes[n] for n in TP_LINEARS if not n.endswith(("o_proj", "down_proj"))} == {"column"}
    assert f["tp_sizes"] == [2]
    assert f["all_params_dtensor"] and f["same_param_objects_in_optimizer"]


def _check_fp8_gemms(f):
    # every converted Linear ran its forward GEMM in FP8 each step; backward: dgrad + wgrad each, all FP8
    assert {n: c for n, c in f["fp8_gemms_fwd_per_module"].items() if c} == {n: tp_scenarios.STEPS for n in TP_LINEARS}
    assert f["fp8_gemms_fwd"] == len(TP_LINEARS) * tp_scenarios.STEPS and f["fp8_gemms_bwd"] == 2 * len(TP_LINEARS) * tp_scenarios.STEPS


def _step0_rel(f):
    """Step 0 agrees to FP8 summation-order noise, plus what TP's split K adds under the rehearsal's
    fast-accumulation model (tests/support/tolerances.py), whose GEMMs must then have run."""
    assert (f["fast_accum_gemms"] == f["fp8_gemms_fwd"] > 0) if tolerances.fast_accum_on() else f["fast_accum_gemms"] == 0
    return tolerances.step0_rel(1e-5, max(f["tp_sizes"]), f["row_parallel_ks"])


def _check_grad_norms(f):
    # the norm clip_grad_norm_ computes over the whole mesh equals the one-process norm within FP8
    # resolution: gradients are cast to E5M2 (scale 1 before the first update), and a last-bit difference
    # of a TP-local GEMM flips single roundings (the exact comparison is in test_rehearsal.py, precision "no")
    assert len(f["grad_norms"]) == tp_scenarios.STEPS and f["reference_grad_norms"][0] > tp_scenarios.CLIP  # clipping acts
    assert f["grad_norms"] == pytest.approx(f["reference_grad_norms"], rel=2e-2)


def test_tp_converts_onto_te_native_tp_with_the_same_dtensor_parameters(tp2):
    for f in tp2:
        assert f["distributed_type"] == "MULTI_GPU" and f["mesh_dims"] == ["tp"]
        _check_conversion(f)


def test_tp_fp8_is_on_and_losses_match_the_single_process_reference(tp2):
    for f in tp2:
        _check_fp8_gemms(f)
        assert f["amax_reductions"] == 2 * tp_scenarios.STEPS and f["amax_group_ranks"] == [0, 1]
        assert f["fp8_state_identical_every_step"] == [True] * tp_scenarios.STEPS
        assert f["losses"][0] == pytest.approx(f["reference"][0], rel=_step0_rel(f))
        assert f["losses"] == pytest.approx(f["reference"], rel=1e-2)
        _check_grad_norms(f)  # clip_grad_norm_ on DTensors (A9) gives the single-process norm


def test_fsdp2_x_tp_converts_trains_in_fp8_and_matches_the_reference(fsdp_tp):
    for f in fsdp_tp:
        assert f["distributed_type"] == "FSDP" and f["mesh_dims"] == ["dp_shard", "tp"]
        _check_conversion(f)
        assert f["amax_group_ranks"] == [0, 1, 2, 3]
        _check_fp8_gemms(f)
        _check_grad_norms(f)
        assert f["fp8_state_identical_every_step"] == [True] * tp_scenarios.STEPS
        assert f["losses"][0] == pytest.approx(f["reference"][0], rel=_step0_rel(f))
        assert f["losses"] == pytest.approx(f["reference"], rel=1e-2)


def test_a_tp_shard_whose_local_dims_misfit_fp8_is_kept_as_a_gpu_would_decide(four_ranks):
    """FSDP2 x TP with an MLP of 48 (a multiple of 16) split into 24 per TP rank: TE's GEMMs see the local
    shard, so conversion is decided on the local dims — the MLP stays high precision, named with its local
    shape, and TE's own ``assert_dim_for_fp8_exec`` never fires (a rule on global dims would convert it and
    fail at the first forward)."""
    for f in scenarios.facts_of(four_ranks, scenarios.key_of([*FOUR_RANK_PLAN], "sc_tp_fp8_train", MISFIT)):
        mlp = set(tp_scenarios._mlp())
        assert set(f["skipped"]) == mlp | {"lm_head"}
        reasons = dict(zip(f["skipped"], f["skip_reasons"]))
        assert all("24" in reasons[n] for n in mlp), reasons
        assert set(f["converted"]) == TP_LINEARS - mlp
        assert {n: c for n, c in f["fp8_gemms_fwd_per_module"].items() if c} == {n: 3 for n in TP_LINEARS - mlp}
        assert f["losses"][0] == pytest.approx(f["reference"][0], rel=_step0_rel(f))
        assert f["losses"] == pytest.approx(f["reference"], rel=1e-2)
        assert f["grad_norms"] == pytest.approx(f["reference_grad_norms"], rel=2e-2)


def test_partial_fp8_warns_once_per_job_at_the_prepare_line(four_ranks):
    """Six MLP Linears kept (24 per TP rank): one RuntimeWarning, on rank 0 only, pointing at the scenario's own
    prepare line, with the coverage figure and the first kept modules with reasons. The full conversion (only the
    output layer kept, by design) warns on no rank."""
    misfit = scenarios.facts_of(four_ranks, scenarios.key_of([*FOUR_RANK_PLAN], "sc_tp_fp8_train", MISFIT))
    assert [len(f["coverage_warnings"]) for f in misfit] == [1, 0, 0, 0]
    (message, filename), = misfit[0]["coverage_warnings"]
    assert filename == "tp_scenarios.py", filename
    assert re.search(r"FP8 covers \d+\.\d% of the model's GEMM parameters: 6 GEMM weight\(s\) stay in high precision "
                     r"besides the output layer lm_head", message), message
    assert "model.layers.0.mlp.gate_proj: " in message and "24" in message and "and 3 more" in message
    assert "ACCEL_FP8_FIX_COVERAGE_WARNING=0" in message
    full = scenarios.facts_of(four_ranks, scenarios.key_of([*FOUR_RANK_PLAN], "sc_tp_fp8_train", {"dp_shard": 2, "tp": 2}))
    assert all(f["coverage_warnings"] == [] for f in full)


def test_no_dtensor_reaches_c10d_in_prepare_or_training(tp2, fsdp_tp):
    for f in tp2 + fsdp_tp:
        assert f["prepare_dtensor_collectives"] == 0 and f["train_dtensor_collectives"] == 0
    # TE's TP comms and the amax reduction ran on the TP / whole-mesh groups, by name
    assert (0, 1) in {tuple(g) for g in tp2[0]["train_groups"]}
    groups = {tuple(g) for g in fsdp_tp[0]["train_groups"]}
    assert (0, 1) in groups and (0, 1, 2, 3) in groups


def test_checkpoint_on_the_2d_mesh_round_trips_bit_for_bit(four_ranks, ckpt_dir):
    assert all(f["save_dtensor_collectives"] == 0 for f in scenarios.facts_of(four_ranks, "sc_tp_checkpoint_save"))
    # reload on the same 2x2 mesh, then on 4x1 (dp_shard 4, no TP) in the same launch
    loaded = scenarios.launch(tp_scenarios, [("sc_tp_checkpoint_load", {"out_dir": ckpt_dir}),
                       ("sc_tp_checkpoint_load", {"out_dir": ckpt_dir, "dp_shard": 4, "tp": None})], 4)
    for name in ("sc_tp_checkpoint_load", "sc_tp_checkpoint_load#1"):
        for f in scenarios.facts_of(loaded, name):
            assert f["param_mismatch"] == [] and f["fp8_mismatch"] == []
            assert f["fp8_compared"] > 0 and f["load_dtensor_collectives"] == 0
