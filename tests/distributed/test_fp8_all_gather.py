"""FP8 all-gather under FSDP2 (issue 21; fixes/all_gather/fp8_all_gather.py): weights gathered as FP8 + scale, masters,
optimizer and checkpoints unchanged, one packed weight-amax all-reduce per step. CPU, gloo, TE's real Python.

Scenarios: tests/support/fp8_all_gather_scenarios.py; one 2-rank launch, one 4-rank launch, and the one-rank
launch the test files share (tests/support/one_rank.py: FSDP2 over one rank takes torch's world-size-1 paths).
"""

import os

import pytest

from support import fp8_all_gather_scenarios
from support import scenarios
from support import tolerances

CONVERTED_WEIGHTS = ["head.weight", "blocks.0.fc1.weight", "blocks.0.fc2.weight", "blocks.1.fc1.weight",
                     "blocks.1.fc2.weight"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8_all_gather")
    return {k: str(root / k) for k in ("on", "off", "fresh_on", "fresh_off")}


BLOCK = {"recipe": "block", "model": "linear_stack", "dim": 256, "out": 256, "steps": 3}
BLOCK_ON = dict(BLOCK, all_gather="fp8", bits=True)
BLOCK_WEIGHTS = ["blocks.0.fc1.weight", "blocks.0.fc2.weight", "blocks.1.fc1.weight", "blocks.1.fc2.weight",
                 "head.weight"]


def _plan2(d):
    return [
        ("sc_train", {"all_gather": "fp8", "recipe": "delayed", "bits": True}),
        ("sc_train", {"all_gather": "high_precision", "recipe": "delayed"}),
        ("sc_train", {"all_gather": "fp8", "recipe": "current", "bits": True}),
        ("sc_train", {"all_gather": "high_precision", "recipe": "current", "reference": False}),
        ("sc_train", {"all_gather": "fp8", "reshard": False, "steps": 3}),
        ("sc_train", {"all_gather": "fp8", "policy": "bf16", "steps": 2, "reference": False}),
        ("sc_train", {"all_gather": "fp8", "model": "linear_stack", "steps": 2, "reference": False}),
        ("sc_train", {"all_gather": "high_precision", "model": "linear_stack", "steps": 2, "reference": False}),
        ("sc_train", {"all_gather": "high_precision", "model": "linear_stack", "steps": 2, "reference": False,
                      "policy": "bf16"}),
        # checkpoints: written with the switch, read without it, and back
        ("sc_train", {"all_gather": "fp8", "steps": 2, "reference": False, "save_dir": d["on"]}),
        ("sc_train", {"all_gather": "high_precision", "steps": 2, "reference": False, "load_dir": d["on"],
                      "save_dir": d["off"]}),
        ("sc_train", {"all_gather": "fp8", "steps": 1, "reference": False, "load_dir": d["off"], "bits": True}),
        ("sc_train", {"all_gather": "fp8", "steps": 0, "reference": False, "save_dir": d["fresh_on"]}),
        ("sc_train", {"all_gather": "high_precision", "steps": 0, "reference": False, "save_dir": d["fresh_off"]}),
        ("sc_bad_input", {"case": "no_fsdp2"}),
        # Float8BlockScaling: dim 256 on 2 ranks, every shard a whole number of 128-row tiles; fp32 policy
        ("sc_train", BLOCK_ON),
        ("sc_train", dict(BLOCK, all_gather="high_precision")),
        ("sc_bad_input", {"case": "block_misaligned"}),
        ("sc_bad_input", {"case": "block_1d"}),
        ("sc_bad_input", {"case": "mxfp8"}),  # last: it switches the rehearsal's target to sm100
        ("sc_bad_input", {"case": "cpu_offload"}),
    ]


@pytest.fixture(scope="module")
def run2(dirs):
    plan = _plan2(dirs)
    results = scenarios.launch(fp8_all_gather_scenarios, plan, 2)
    return lambda name, kwargs: scenarios.facts_of(results, scenarios.key_of(plan, name, kwargs))


def _f(run2, dirs, i):
    name, kwargs = _plan2(dirs)[i]
    return run2(name, kwargs)


def test_weights_are_gathered_in_fp8_and_te_gets_them_quantized(run2, dirs):
    for f in _f(run2, dirs, 0):
        assert f["gathered_weights"] == CONVERTED_WEIGHTS
        assert f["te_linear_weight_types"] == ["Float8Tensor"]  # TE's QuantizedTensor weight path: no re-quantizing
        assert f["eval_output_finite"]  # an eval pass (TE autocast off) on the gathered FP8 weight
        for step in f["per_step"]:
            # one uint8 all-gather per FSDP2 unit (LayerNorm and bias bytes ride along as uint8 views)
            assert step["all_gather_dtypes"] == ["torch.uint8"]
        # every converted Linear still runs all three GEMMs in FP8
        assert f["fp8_gemms_fwd"] == 5 * fp8_all_gather_scenarios.STEPS and f["fp8_gemms_bwd"] == 10 * fp8_all_gather_scenarios.STEPS and f["non_fp8_gemms"] == 0


def test_one_packed_weight_amax_all_reduce_per_step(run2, dirs):
    on, off = _f(run2, dirs, 0), _f(run2, dirs, 1)
    for f_on, f_off in zip(on, off):
        assert f_on["scale_reductions"] == fp8_all_gather_scenarios.STEPS
        for s_on, s_off in zip(f_on["per_step"], f_off["per_step"]):
            extra = list(s_on["all_reduces"])
            for n in s_off["all_reduces"]:
                if n in extra:
                    extra.remove(n)
            assert extra == [len(CONVERTED_WEIGHTS)], (s_on["all_reduces"], s_off["all_reduces"])


def test_te_gets_the_whole_weights_quantization_bit_for_bit_every_step(run2, dirs):
    """Per-tensor recipes: the Float8Tensor each TE Linear receives (gathered shards + the packed all-reduce's
    scale) has exactly the bytes and scale_inv of TE's Float8Quantizer applied to the whole master weight at TE's
    current-scaling scale of its amax, every step; also after a load_state that follows a forward (the load moves
    the shards' version counters: the next forward recomputes)."""
    weights = sorted(w.rsplit(".", 1)[0] for w in CONVERTED_WEIGHTS)
    for i, steps in ((0, fp8_all_gather_scenarios.STEPS), (2, fp8_all_gather_scenarios.STEPS), (11, 1)):
        for f in _f(run2, dirs, i):
            assert f["bits"] == {"compared": weights, "steps": steps, "mismatched": []}, (i, f["bits"])


def test_no_collective_inside_fsdp2s_all_gather_hooks_and_the_metadata_is_allocated_once(run2, dirs):
    """The packed weight-amax all-reduce runs in the prepared model's forward pre-hook, before FSDP2's root
    unshard: the rank's collective-order recorder saw none inside fsdp_pre_all_gather / fsdp_post_all_gather (every
    launch's audit fails on one: tests/distributed/test_collective_order.py plants one), and every gather of a
    weight passed the same scale_inv storage (a view of the buffer written in place), not a fresh clone."""
    for i in (0, 2, 4, 15):
        for f in _f(run2, dirs, i):
            assert f["collectives_recorded"] > 0 and f["collectives_inside_hooks"] == [], (i, f["collectives_inside_hooks"])
            assert f["first_forward_pre_hook"] == "_before_forward"  # in front of FSDP2's root pre-forward
    assert _f(run2, dirs, 1)[0]["first_forward_pre_hook"] == "FSDPState._pre_forward"  # switch off: FSDP2's first
    for i in (0, 2):
        for f in _f(run2, dirs, i):
            assert f["scale_reductions"] == fp8_all_gather_scenarios.STEPS
            # blocks.0.fc1: resharded after forward, so gathered in forward and again in backward, every step
            assert f["metadata"] == {"gathers": 2 * fp8_all_gather_scenarios.STEPS, "scale_storages": 1}, f["metadata"]


def test_losses_and_grad_norms_match_the_one_process_reference_every_step(run2, dirs):
    """Delayed scaling: step 0 exact (the same FP8 bits of the same weights, same activation scales), later steps
    within FP8 resolution (gradient summation order). Current scaling: TE scales each rank's activations with its
    own amax, the one-process reference with the whole batch's, so within FP8 resolution from step 0 (the switch-off
    run is the exact comparison: test_switch_on_and_off_agree_within_fp8_resolution)."""
    for i in (0, 1, 2):  # delayed on, delayed off, current on
        for f in _f(run2, dirs, i):
            if i != 2:
                assert f["losses"][0] == pytest.approx(f["reference"][0], rel=1e-6)
            assert f["losses"] == pytest.approx(f["reference"], rel=1e-2)
            assert f["grad_norms"] == pytest.approx(f["reference_grad_norms"], rel=2e-2)


def test_switch_on_and_off_agree_within_fp8_resolution(run2, dirs):
    for on_i, off_i in ((0, 1), (2, 3)):
        for on, off in zip(_f(run2, dirs, on_i), _f(run2, dirs, off_i)):
            assert on["losses"] == pytest.approx(off["losses"], rel=5e-2)
            assert on["grad_norms"] == pytest.approx(off["grad_norms"], rel=5e-2)
    # current scaling: TE quantizes the gathered full weight with the same whole-weight scale: step 0 identical
    for on, off in zip(_f(run2, dirs, 2), _f(run2, dirs, 3)):
        assert on["losses"][0] == pytest.approx(off["losses"][0], rel=1e-6)


def test_masters_optimizer_and_state_dict_stay_high_precision(run2, dirs):
    for i in (0, 5):
        for f in _f(run2, dirs, i):
            assert f["param_dtypes"] == ["torch.float32"]
            assert f["local_tensor_types"] == ["Tensor"] or f["local_tensor_types"] == ["Fp8AllGatherShard", "Tensor"]
            assert f["state_dict_types"] in (["Tensor"], ["Fp8AllGatherShard", "Tensor"])
            assert f["optimizer_param_types"] == ["DTensor"]


def test_bytes_per_converted_parameter(run2, dirs):
    """All gathered parameters are converted weights (linear_stack): bytes per gathered parameter, measured at c10d
    (FSDP2's all-gather outputs): 1 with the switch (uint8), 2 without it under a bf16 policy, 4 under fp32; and the
    peak of unsharded weights held in forward halves against bf16."""
    on, off32, off16 = _f(run2, dirs, 6), _f(run2, dirs, 7), _f(run2, dirs, 8)
    for facts, want, dtype in ((on, 1, "torch.uint8"), (off32, 4, "torch.float32"), (off16, 2, "torch.bfloat16")):
        for f in facts:
            step = f["per_step"][-1]
            assert step["all_gathers"] > 0 and step["all_gather_dtypes"] == [dtype]
            assert step["all_gathered_bytes"] == want * step["all_gathered_numel"]
            assert step["all_gathered_numel"] == off32[0]["per_step"][-1]["all_gathered_numel"]  # same schedule
    for f_on, f_16 in zip(on, off16):
        assert 2 * f_on["peak_unsharded_bytes_forward"] == f_16["peak_unsharded_bytes_forward"]


def test_reshard_after_forward_off_and_bf16_policy(run2, dirs):
    for f in _f(run2, dirs, 4):
        assert f["losses"] == pytest.approx(f["reference"], rel=1e-2)
        assert f["scale_reductions"] == 3
    for f in _f(run2, dirs, 5):
        assert f["per_step"][0]["all_gather_dtypes"] == ["torch.uint8"] and f["fp8_gemms_fwd"] == 10


def test_checkpoints_round_trip_across_the_switch(run2, dirs):
    saved_on, loaded_off, loaded_on = _f(run2, dirs, 9), _f(run2, dirs, 10), _f(run2, dirs, 11)
    for a, b, c in zip(saved_on, loaded_off, loaded_on):
        assert b["digest_after_load"] == a["digest_at_save"]
        assert c["digest_after_load"] == b["digest_at_save"]
    assert saved_on[0]["full_state_dict"] == loaded_off[0]["full_state_dict"]
    assert {v[0] for v in saved_on[0]["full_state_dict"].values()} == {"torch.float32"}


def _dcp_contents(folder, out):
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(folder, out)
    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            flat[prefix] = value

    walk("", torch.load(out, weights_only=False))
    return flat


def test_checkpoint_contents_are_the_same_with_and_without_the_switch(run2, dirs, tmp_path):
    """The same model saved right after prepare with and without the switch: the same files, and every tensor of
    the sharded checkpoint the same dtype and bits (the files themselves differ only in torch.save's storage keys,
    which are addresses, as between two runs without the switch)."""
    import torch

    _f(run2, dirs, 12), _f(run2, dirs, 13)
    on, off = dirs["fresh_on"], dirs["fresh_off"]
    files = sorted(os.path.relpath(os.path.join(r, n), on) for r, _, ns in os.walk(on) for n in ns)
    assert files and files == sorted(os.path.relpath(os.path.join(r, n), off) for r, _, ns in os.walk(off) for n in ns)
    a = _dcp_contents(os.path.join(on, "pytorch_model_fsdp_0"), tmp_path / "on.pt")
    b = _dcp_contents(os.path.join(off, "pytorch_model_fsdp_0"), tmp_path / "off.pt")
    assert sorted(a) == sorted(b)
    tensors = [k for k in a if isinstance(a[k], torch.Tensor)]
    assert len(tensors) >= 10
    for k in tensors:
        assert type(a[k]) is torch.Tensor and a[k].dtype == b[k].dtype, k
        if k.endswith("_extra_state"):  # TE's pickled FP8 state: the same entries and values
            assert _decoded(a[k]) == _decoded(b[k]), k
        else:
            assert a[k].dtype == torch.float32 and torch.equal(a[k], b[k]), k


def _decoded(extra):
    import pickle

    import torch

    class _Stub:  # TE's recipe classes, without importing TE here
        def __init__(self, *args, **kwargs):
            self.args = (args, kwargs)

        def __repr__(self):
            return f"{type(self).__name__}{vars(self)}"

    class _Unpickler(pickle.Unpickler):
        def find_class(self, module, name):
            if module.startswith("transformer_engine"):
                return type(name, (_Stub,), {})
            return super().find_class(module, name)

    if not extra.numel():
        return None
    import io

    state = _Unpickler(io.BytesIO(extra.numpy().tobytes())).load()
    return {k: (v.tolist() if isinstance(v, torch.Tensor) else repr(v)) for k, v in state.items()}


def _block(run2, all_gather):
    return run2("sc_train", BLOCK_ON if all_gather == "fp8" else dict(BLOCK, all_gather=all_gather))


def test_block_scaling_gathers_the_whole_weights_tiles_bit_for_bit(run2):
    """Float8BlockScaling: each shard is quantized tile by tile (128x128, TE's Float8BlockQuantizer with the recipe's
    weight settings) before the all-gather; the Float8BlockwiseQTensor TE's Linear receives has exactly the bytes
    and scales of TE's quantizer applied to the whole master weight — no amax exchange at all."""
    for f in _block(run2, "fp8"):
        assert sorted(f["gathered_weights"]) == sorted(BLOCK_WEIGHTS)
        assert f["te_linear_weight_types"] == ["Float8BlockwiseQTensor"]
        assert f["bits"] == {"compared": ["blocks.0.fc1", "blocks.0.fc2", "blocks.1.fc1", "blocks.1.fc2", "head"],
                             "steps": 3, "mismatched": []}
        assert f["scale_reductions"] == 0 and all(s["weight_amax_reductions"] == 0 for s in f["per_step"])
        # 5 Linears: fprop each; wgrad each + dgrad for all but blocks.0.fc1 (its input, the data, needs no grad)
        assert f["fp8_gemms_fwd"] == 5 * 3 and f["fp8_gemms_bwd"] == 9 * 3 and f["non_fp8_gemms"] == 0
        assert f["eval_output_finite"]


def test_block_scaling_bytes_all_reduces_and_numerics(run2):
    """Bytes: 1 a parameter plus the tile scales (fp32, one per 128x128 tile, padded to 4 a row of tiles: < 0.1 %)
    against 4 without the switch (fp32 policy); the same all-reduces as without the switch (none added). Numerics: the same
    tiles either way (fp32 policy), so losses and clipped grad norms are IDENTICAL to the switch-off run every step,
    and match the one-process reference (step 0 to rounding, later within FP8 resolution)."""
    on, off = _block(run2, "fp8"), _block(run2, "high_precision")
    for f_on, f_off in zip(on, off):
        for s_on, s_off in zip(f_on["per_step"], f_off["per_step"]):
            assert s_off["all_gather_dtypes"] == ["torch.float32"] and s_on["all_gather_dtypes"] == ["torch.uint8"]
            assert s_on["all_gathered_numel"] == s_on["all_gathered_bytes"]
            # the tile scales (+ the alignment padding FSDP2 gives each input of a mixed-dtype all-gather on some
            # torch releases: 2.11 pads more): a few hundred bytes against ~2.4 M parameters
            extra = s_on["all_gathered_bytes"] - s_off["all_gathered_numel"]
            assert f_on["gathered_scale_bytes"] <= extra <= 0.001 * s_off["all_gathered_numel"], (extra, f_on)
            assert s_off["all_gathered_bytes"] == 4 * s_off["all_gathered_numel"]
            assert sorted(s_on["all_reduces"]) == sorted(s_off["all_reduces"])
        assert f_on["losses"] == f_off["losses"] and f_on["grad_norms"] == f_off["grad_norms"]
        assert f_on["losses"][0] == pytest.approx(f_on["reference"][0], rel=1e-6)
        assert f_on["losses"] == pytest.approx(f_on["reference"], rel=1e-2)
        assert f_on["grad_norms"] == pytest.approx(f_on["reference_grad_norms"], rel=2e-2)


def test_block_scaling_refusals_name_the_weights_and_the_setting(run2):
    for f in run2("sc_bad_input", {"case": "block_misaligned"}):
        assert f["error_type"] == "Fp8AllGatherError", f
        for name in ("blocks.0.fc1.weight", "blocks.1.fc2.weight", "head.weight"):
            assert name in f["error"]
        assert "not a multiple of 128" in f["error"] and "ACCELERATE_FP8_ALL_GATHER" in f["error"]
        assert "Fp8AllGatherShard" not in f["local_tensor_types"]  # no weight half-switched
    for f in run2("sc_bad_input", {"case": "block_1d"}):
        assert f["error_type"] == "Fp8AllGatherError" and "w_block_scaling_dim=1" in f["error"]
        assert not any(t.startswith("TE") for t in f["linear_types"])  # refused before sharding / conversion


@pytest.mark.parametrize("case,needle", [("no_fsdp2", "needs FSDP2"), ("mxfp8", "MXFP8BlockScaling"),
                                         ("cpu_offload", "CPU offload")])
def test_bad_input_is_one_named_error_at_prepare(run2, dirs, case, needle):
    for f in run2("sc_bad_input", {"case": case}):
        assert f["error_type"] == "Fp8AllGatherError", f
        assert needle in f["error"] and "ACCELERATE_FP8_ALL_GATHER" in f["error"]
        assert "Linear" in f["linear_types"] and not any(t.startswith("TE") for t in f["linear_types"])


# -- transformers models: Llama and Qwen3, FSDP2 on 2 ranks; HSDP, FSDP2 x TP (TE-native TP) and activation
# checkpointing on 4 ---------------------------------------------------------------------------------------------
LLM_WEIGHTS = 14  # 2 layers x (q, k, v, o, gate, up, down); lm_head stays high precision (the output layer)
PLAN_LLM_2 = [("sc_llm", {"family": "llama"}), ("sc_llm", {"family": "llama", "all_gather": "high_precision"}),
              ("sc_llm", {"family": "qwen3"})]
# packed MoE experts gathered in FP8 (issue 30 item 2), in the same launches: a Qwen3-MoE with a real model's
# proportions (32 experts, top-8: experts ~85 % of the parameters) and GPT-OSS's [E, in, out] biased experts
MOE_ON = ("sc_moe", {"recipe": "current"})
MOE_BYTES = [("sc_moe", {"policy": "bf16", "all_gather": mode, "steps": 1, "reference": False})
             for mode in ("fp8", "high_precision")]
MOE_GPT_OSS = ("sc_moe", {"family": "gpt_oss", "recipe": "current", "steps": 2})
# Float8 block scaling: a Qwen3-MoE 256 wide (every Linear's shard whole 128x128 tiles on 2 ranks), 4 experts
MOE_BLOCK = [("sc_moe", {"family": "qwen3_moe_256", "recipe": "block", "steps": 2, "all_gather": mode,
                         "reference": mode == "fp8"}) for mode in ("fp8", "high_precision")]
PLAN_LLM_2 += [MOE_ON, *MOE_BYTES, MOE_GPT_OSS, *MOE_BLOCK]
MOE_4 = [("sc_moe", {"recipe": "current", "dp_replicate": 2, "dp_shard": 2, "steps": 2}),  # HSDP 2 x 2
         ("sc_moe", {"family": "qwen3_moe_proportioned_6", "recipe": "current", "steps": 2}),  # 6 experts: 2, 2, 2, 0
         # FSDP2 x TP (transformers' packed-colwise / rowwise experts) and EP loaded by transformers (fsdp 4 x ep 2)
         ("sc_moe", {"family": "qwen3_moe", "recipe": "current", "dp_shard": 2, "tp": 2, "steps": 2}),
         ("sc_moe", {"family": "qwen3_moe", "recipe": "current", "dp_shard": 4, "ep": 2, "steps": 2})]


@pytest.fixture(scope="module")
def llm_dirs(tmp_path_factory):
    return str(tmp_path_factory.mktemp("fp8_all_gather_llm"))


def _plan_llm_4(ckpt):
    return [("sc_llm", {"family": "llama", "dp_replicate": 2, "dp_shard": 2}),
            ("sc_llm", {"family": "llama", "dp_shard": 2, "tp": 2, "ckpt_dir": ckpt}),
            ("sc_llm", {"family": "qwen3", "dp_shard": 2, "tp": 2}),
            ("sc_llm", {"family": "llama", "dp_shard": 4, "grad_ckpt": True}),
            ("sc_llm", {"family": "llama", "dp_shard": 2, "tp": 2, "loaded": True}),
            ("sc_llm", {"family": "qwen3", "dp_shard": 4, "ram_efficient": True}),
            ("sc_llm", {"family": "llama", "dp_shard": 4, "recipe": "current", "accelerate_ac": True})] + MOE_4


@pytest.fixture(scope="module")
def llm2():
    results = scenarios.launch(fp8_all_gather_scenarios, PLAN_LLM_2, 2)
    return [scenarios.facts_of(results, scenarios.key_of(PLAN_LLM_2, n, kw)) for n, kw in PLAN_LLM_2][:3]


@pytest.fixture(scope="module")
def moe2():
    results = scenarios.launch(fp8_all_gather_scenarios, PLAN_LLM_2, 2)  # the same launch as llm2 (memoised)
    return {(n, tuple(sorted(kw.items()))): scenarios.facts_of(results, scenarios.key_of(PLAN_LLM_2, n, kw))
            for n, kw in PLAN_LLM_2 if n == "sc_moe"}


@pytest.fixture(scope="module")
def llm4(llm_dirs):
    plan = _plan_llm_4(llm_dirs)
    results = scenarios.launch(fp8_all_gather_scenarios, plan, 4)
    return [scenarios.facts_of(results, scenarios.key_of(plan, n, kw)) for n, kw in plan if n == "sc_llm"]


@pytest.fixture(scope="module")
def moe4(llm_dirs):
    plan = _plan_llm_4(llm_dirs)
    results = scenarios.launch(fp8_all_gather_scenarios, plan, 4)  # the same launch as llm4 (memoised)
    return [scenarios.facts_of(results, scenarios.key_of(plan, n, kw)) for n, kw in MOE_4]


def _check_llm(facts, gathered=True):
    for f in facts:
        # current scaling: each rank scales its activations by its own amax, the reference by the whole batch's;
        # under the rehearsal's fast-accumulation model TP's split K adds its bound (tests/support/tolerances.py)
        step0 = tolerances.step0_rel(1e-6, f["tp"], f["row_parallel_ks"]) if f["recipe"] == "delayed" else 1e-2
        assert f["losses"][0] == pytest.approx(f["reference"][0], rel=step0)
        assert f["losses"] == pytest.approx(f["reference"], rel=1e-2)
        assert f["grad_norms"] == pytest.approx(f["reference_grad_norms"], rel=2e-2)
        assert f["non_fp8_gemms"] == 0 and f["fp8_gemms_fwd"] == LLM_WEIGHTS * len(f["losses"])
        if not gathered:
            assert f["te_linear_weight_types"] == ["Parameter"]  # FSDP2's unsharded high-precision parameter
        if gathered:  # TE's forward received TE Float8Tensors built from the gathered bytes, nothing else
            assert f["te_linear_weight_types"] == ["Float8Tensor"]
            assert len(f["gathered_weights"]) == LLM_WEIGHTS and "lm_head.weight" not in f["gathered_weights"]
            assert f["weight_amax_reductions"] == [1] * len(f["losses"])


def test_llama_and_qwen3_under_fsdp2_match_the_reference_every_step(llm2):
    llama_on, llama_off, qwen3_on = llm2
    _check_llm(llama_on)
    _check_llm(qwen3_on)
    _check_llm(llama_off, gathered=False)
    for on, off in zip(llama_on, llama_off):
        assert on["losses"] == pytest.approx(off["losses"], rel=1e-2)
        assert on["grad_norms"] == pytest.approx(off["grad_norms"], rel=2e-2)


def test_hsdp_fsdp2_x_tp_activation_checkpointing_nd_loading_and_ram_efficient_loading(llm4):
    """HSDP 2x2, FSDP2 x TP 2x2 (TE-native TP; Llama with a checkpoint round trip, Qwen3), transformers'
    activation checkpointing, accelerate's own (the plugin's ``activation_checkpointing``) with the current recipe
    on 4 ranks, a model transformers sharded at load (DistributedConfig tp 2 x fsdp 2: its loader
    replaced the shards' storage after fully_shard, FSDP2's lazy init then replaces the local tensors; the
    extension is re-applied) and cpu_ram_efficient_loading."""
    hsdp, tp_llama, tp_qwen3, grad_ckpt, loaded, ram_efficient, current_accelerate_ac = llm4
    for f in current_accelerate_ac:  # accelerate's own FSDP2 activation checkpointing, current scaling, 4 ranks
        # torch's CheckpointWrapper around each decoder layer, made an FSDP2 unit (fully_shard renames the class)
        assert f["checkpoint_wrapped"] == ["FSDPCheckpointWrapper"] and f["recipe"] == "current"
    for facts in llm4:
        _check_llm(facts)
    for f in tp_llama:  # save_state / load_state with the switch under FSDP2 x TP: every parameter back
        assert f["checkpoint_param_mismatch"] == [] and f["loaded_loss_finite"]


# -- one rank (tests/support/one_rank.py): FSDP2 over one rank takes torch's world-size-1 shortcut — no all-gather,
# only the FIRST tensor fsdp_pre_all_gather returns copied into FSDP2's output buffer (the block scale grid rides in
# the metadata) ----------------------------------------------------------------------------------------------------
def _one(one_rank, **kwargs):
    return one_rank("fp8_all_gather_scenarios", "sc_train", **kwargs)


ONE_RANK_RECIPES = [({"recipe": "delayed"}, CONVERTED_WEIGHTS, "Float8Tensor", fp8_all_gather_scenarios.STEPS, (5, 10)),
                    ({"recipe": "current"}, CONVERTED_WEIGHTS, "Float8Tensor", fp8_all_gather_scenarios.STEPS, (5, 10)),
                    (dict(BLOCK), BLOCK_WEIGHTS, "Float8BlockwiseQTensor", 3, (5, 9))]


@pytest.mark.parametrize("kwargs,weights,te_type,steps,gemms", ONE_RANK_RECIPES, ids=["delayed", "current", "block"])
def test_one_rank_every_recipe_gives_te_the_whole_weights_quantization_bit_for_bit(one_rank, kwargs, weights,
                                                                                    te_type, steps, gemms):
    f = _one(one_rank, **kwargs, all_gather="fp8", bits=True)
    assert sorted(f["gathered_weights"]) == sorted(weights) and f["te_linear_weight_types"] == [te_type]
    assert f["bits"] == {"compared": sorted(w.rsplit(".", 1)[0] for w in weights), "steps": steps, "mismatched": []}
    assert all(step["all_gathers"] == 0 for step in f["per_step"])  # FSDP2's shortcut: no collective at all
    assert f["collectives_recorded"] > 0 and f["collectives_inside_hooks"] == []
    fwd, bwd = gemms
    assert (f["fp8_gemms_fwd"], f["fp8_gemms_bwd"], f["non_fp8_gemms"]) == (fwd * steps, bwd * steps, 0)
    assert f["eval_output_finite"]


@pytest.mark.parametrize("kwargs,steps", [({"recipe": "delayed"}, fp8_all_gather_scenarios.STEPS), ({"recipe": "current"}, fp8_all_gather_scenarios.STEPS),
                                          (dict(BLOCK), 3)], ids=["delayed", "current", "block"])
def test_one_rank_losses_grad_norms_and_the_packed_all_reduce_against_the_reference_and_the_switch_off(
        one_rank, kwargs, steps):
    """One rank holds the whole batch: the one-process reference sees the same activations, so step 0 is exact
    under every recipe (current scaling too, unlike 2 ranks); the switch-off run as at 2 ranks: within FP8
    resolution, step 0 identical where both quantize the weight with the same scale (current; block: identical
    every step — the delayed recipe's switch-off run scales weights from the amax history instead)."""
    on, off = _one(one_rank, **kwargs, all_gather="fp8", bits=True), _one(one_rank, **kwargs, all_gather="high_precision",
                                                                            **({"reference": False} if kwargs.get("recipe") == "current" else {}))
    assert on["losses"][0] == pytest.approx(on["reference"][0], rel=1e-6)
    assert on["losses"] == pytest.approx(on["reference"], rel=1e-2)
    assert on["grad_norms"] == pytest.approx(on["reference_grad_norms"], rel=2e-2)
    if kwargs.get("recipe") != "delayed":
        assert on["losses"][0] == pytest.approx(off["losses"][0], rel=1e-6)
    assert on["losses"] == pytest.approx(off["losses"], rel=5e-2)
    assert on["grad_norms"] == pytest.approx(off["grad_norms"], rel=5e-2)
    if kwargs.get("recipe") == "block":  # the same tiles either way, no amax exchange
        assert on["losses"] == off["losses"] and on["grad_norms"] == off["grad_norms"]
        assert [s["weight_amax_reductions"] for s in on["per_step"]] == [0] * steps
    else:  # one packed all-reduce a step (on the one-rank amax group), nothing else added
        assert [s["weight_amax_reductions"] for s in on["per_step"]] == [1] * steps
        for s_on, s_off in zip(on["per_step"], off["per_step"]):
            extra = list(s_on["all_reduces"])
            for n in s_off["all_reduces"]:
                extra.remove(n)
            assert extra == [len(CONVERTED_WEIGHTS)]
        assert on["metadata"] == {"gathers": 2 * steps, "scale_storages": 1}


def test_one_rank_bytes_of_the_unsharded_weights(one_rank):
    """No all-gather at one rank: the bytes are FSDP2's output buffers the shortcut copies into, held while the
    weights are unsharded — 1 a parameter with the switch (uint8; block scaling too: its tile scales ride in the
    metadata), 4 without it under an fp32 policy, 2 under bf16."""
    on = _one(one_rank, all_gather="fp8", model="linear_stack", steps=2, reference=False, policy="fp32")
    off32, off16 = (_one(one_rank, all_gather="high_precision", model="linear_stack", steps=2, reference=False,
                         policy=policy) for policy in ("fp32", "bf16"))
    assert on["peak_unsharded_bytes_forward"] > 0
    assert 4 * on["peak_unsharded_bytes_forward"] == off32["peak_unsharded_bytes_forward"]
    assert 2 * on["peak_unsharded_bytes_forward"] == off16["peak_unsharded_bytes_forward"]
    block_on, block_off = _one(one_rank, **BLOCK, all_gather="fp8", bits=True), _one(one_rank, **BLOCK,
                                                                                  all_gather="high_precision")
    assert 4 * block_on["peak_unsharded_bytes_forward"] == block_off["peak_unsharded_bytes_forward"]
    for f in (on, off32, off16, block_on, block_off):
        assert all(step["all_gathers"] == 0 and step["all_gathered_bytes"] == 0 for step in f["per_step"])


@pytest.mark.parametrize("modify,mismatched", [("in_place", []), ("data_then_weights_changed", []),
                                               ("data_only", ["blocks.0.fc1"])])
def test_one_rank_weights_changed_between_steps(one_rank, modify, mismatched):
    """With no optimizer step, a user's edit between steps is the only change. In place it moves the version
    counters: the next forward recomputes the scales (TE gets the new weight's quantization bit for bit). A
    ``.data`` write moves none: after weights_changed() it is the same; without it the last scales stay (what
    docs/fixes.md says is not seen — and what shows the bit check can fail)."""
    f = _one(one_rank, all_gather="fp8", steps=3, reference=False, bits=True, modify=modify)
    assert f["bits"]["steps"] == 3 and f["bits"]["mismatched"] == mismatched
    assert [s["weight_amax_reductions"] for s in f["per_step"]] == ([1, 1, 1] if modify != "data_only" else [1, 0, 0])


def test_one_rank_checkpoints_and_activation_checkpointing_with_the_switch(one_rank, tmp_path):
    """Llama: save_state, load_state into a differently initialised model, every parameter bit for bit, the loaded
    model trains; Llama with transformers' activation checkpointing; block scaling: saved and loaded digests equal,
    and the first step after the load gathers the loaded weights' tiles bit for bit."""
    f = one_rank("fp8_all_gather_scenarios", "sc_llm", family="llama", ckpt_dir=one_rank.path("llm"))
    _check_llm([f])
    assert f["checkpoint_param_mismatch"] == [] and f["loaded_loss_finite"]
    f = one_rank("fp8_all_gather_scenarios", "sc_llm", family="llama", grad_ckpt=True)
    _check_llm([f])  # the recompute gathers again, with the step's scales: one reduction a step
    saved = _one(one_rank, **dict(BLOCK, steps=2), all_gather="fp8", reference=False, save_dir=one_rank.path("block_on"))
    loaded = _one(one_rank, **dict(BLOCK, steps=1), all_gather="fp8", reference=False,
                  load_dir=one_rank.path("block_on"), bits=True)
    assert loaded["digest_after_load"] == saved["digest_at_save"]
    assert loaded["bits"]["mismatched"] == [] and loaded["bits"]["steps"] == 1


def test_one_rank_a_forward_that_bypasses_the_prepared_model_after_a_change_is_refused_by_name(one_rank):
    f = one_rank("fp8_all_gather_scenarios", "sc_stale")
    assert f["error_type"] == "Fp8AllGatherError" and f["reductions"] == 1
    assert "blocks.0.fc1.weight" in f["error"] and "its shard changed since the weight scales were computed" in f["error"]
    assert "weights_changed()" in f["error"]


# packed MoE experts gathered in FP8 (fixes/all_gather/fp8_experts_gather.py) ------------------------------------------------
EXPERT_WEIGHTS = [f"model.layers.{i}.mlp.experts.{w}" for i in range(2) for w in ("gate_up_proj", "down_proj")]


def _moe(moe2, spec):
    name, kw = spec
    return moe2[(name, tuple(sorted(kw.items())))]


def _check_moe_gathered(facts, steps):
    for f in facts:
        assert f["gathered_experts"] == EXPERT_WEIGHTS and f["kept"] == {}
        assert set(EXPERT_WEIGHTS) <= set(f["gathered_weights"])
        assert f["expert_weight_types"] == ["Fp8Experts"]  # the experts' forward received the gathered bytes
        # each expert quantized with its own scale: bytes and E scales equal TE's quantizer on each whole master
        # expert at TE's compute_scale_from_amax of that expert's amax, every step
        assert f["bits"] == {"compared": sorted(EXPERT_WEIGHTS), "steps": steps, "mismatched": []}
        assert f["amax_reductions"] == steps  # the experts' amaxes ride in the one packed all-reduce a step
        assert f["per_step"][-1]["all_gather_dtypes"] == ["torch.float32", "torch.uint8"]
        # masters, checkpoints and the optimizer never see FP8
        assert f["local_tensor_types"] == ["Tensor"] and f["state_dict_types"] == ["Tensor"]
        assert f["param_dtypes"] == ["torch.float32"] and f["eval_output_finite"]


def _check_moe_reference(facts):
    """Against one process with the same FP8 weights (each converted weight quantized per step as the switch does:
    per tensor, per expert): current scaling differs only by each rank's own activation amax."""
    for f in facts:
        assert f["losses"] == pytest.approx(f["reference"], rel=1e-3)
        assert f["grad_norms"] == pytest.approx(f["reference_grad_norms"], rel=1e-2)


def test_moe_experts_are_gathered_in_fp8_with_a_scale_per_expert(moe2, moe4):
    on = _moe(moe2, MOE_ON)
    _check_moe_gathered(on, 3)
    _check_moe_reference(on)
    for facts in moe4:  # HSDP 2 x 2; 6 experts over 4 shard ranks (2, 2, 2 and none); FSDP2 x TP; EP
        _check_moe_gathered(facts, 2)
        _check_moe_reference(facts)


def test_gpt_oss_transposed_biased_experts_are_gathered_in_fp8(moe2):
    facts = _moe(moe2, MOE_GPT_OSS)
    _check_moe_gathered(facts, 2)
    _check_moe_reference(facts)


def test_moe_all_gather_moves_about_half_the_bytes_under_a_bf16_policy(moe2):
    """The issue's bound: all-gathered bytes per step with the switch on / off <= 0.55 under a bf16 param_dtype on
    a MoE model whose experts hold most of the parameters (here ~85 %)."""
    on, off = (_moe(moe2, spec) for spec in MOE_BYTES)
    for f_on, f_off in zip(on, off):
        assert f_on["expert_share"] > 0.8
        assert f_off["expert_weight_types"] == ["Parameter"] and f_off["per_step"][0]["all_gather_dtypes"] == [
            "torch.bfloat16"]
        ratio = f_on["per_step"][0]["all_gathered_bytes"] / f_off["per_step"][0]["all_gathered_bytes"]
        assert ratio <= 0.55, ratio
        assert f_on["per_step"][0]["all_gather_dtypes"] == ["torch.bfloat16", "torch.uint8"]


def test_moe_experts_are_gathered_tile_by_tile_under_block_scaling(moe2):
    """Float8BlockScaling: each expert quantized in 128x128 tiles on its shard, the tile grids gathered beside the
    bytes, no amax exchange; TE's grouped GEMM receives each expert as TE would have quantized it, so the run is
    the switch-off run exactly."""
    on, off = (_moe(moe2, spec) for spec in MOE_BLOCK)
    for f_on, f_off in zip(on, off):
        assert f_on["gathered_experts"] == EXPERT_WEIGHTS and f_on["kept"] == {}
        assert f_on["expert_weight_types"] == ["Fp8Experts"] and f_off["expert_weight_types"] == ["Parameter"]
        assert f_on["bits"] == {"compared": sorted(EXPERT_WEIGHTS), "steps": 2, "mismatched": []}
        assert f_on["amax_reductions"] == 0 and f_on["per_step"][-1]["all_reduces"] == []  # nothing exchanged
        assert f_on["losses"] == f_off["losses"] and f_on["grad_norms"] == f_off["grad_norms"]
        assert f_on["losses"] == pytest.approx(f_on["reference"], rel=1e-3)
        assert f_on["per_step"][-1]["all_gathered_bytes"] / f_off["per_step"][-1]["all_gathered_bytes"] < 0.32


def test_one_rank_moe_experts_are_gathered_in_fp8(one_rank):
    """FSDP2 over one rank (no all-gather: FSDP2 copies the first input): per-tensor experts with their E scales in
    the metadata, block-scaled experts with their tile grids there, bit for bit every step."""
    current = one_rank("fp8_all_gather_scenarios", "sc_moe", family="qwen3_moe", recipe="current", steps=2)
    block = one_rank("fp8_all_gather_scenarios", "sc_moe", family="qwen3_moe_256", recipe="block", steps=2)
    for f, reductions in ((current, 2), (block, 0)):
        assert f["gathered_experts"] == EXPERT_WEIGHTS and f["kept"] == {}
        assert f["expert_weight_types"] == ["Fp8Experts"] and f["amax_reductions"] == reductions
        assert f["bits"] == {"compared": sorted(EXPERT_WEIGHTS), "steps": 2, "mismatched": []}
        assert f["per_step"][-1]["all_gathered_bytes"] == 0  # one shard rank: FSDP2 gathers nothing
        assert f["state_dict_types"] == ["Tensor"] and f["param_dtypes"] == ["torch.float32"]
        assert f["eval_output_finite"]
        assert f["losses"] == pytest.approx(f["reference"], rel=1e-3)
    assert current["grad_norms"] == pytest.approx(current["reference_grad_norms"], rel=1e-2)
