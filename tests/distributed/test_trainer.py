"""transformers' ``Trainer``, script unchanged, configured by an accelerate config file (docs/trainer.md): FSDP2,
FSDP2 x TP with a model loaded N-D through ``DistributedConfig`` (A22) and a Qwen3-MoE loaded with transformers'
expert parallelism (issue 30) train in FP8 like one process; and
``TrainingArguments(use_cpu=True)`` with an FSDP2 config under the rehearsal warns, naming what is dropped.
One 4-rank launch (tests/support/trainer_scenarios.py)."""

import pytest

from support import scenarios
from support import trainer_scenarios


@pytest.fixture(scope="module")
def launched():
    return scenarios.launch(trainer_scenarios, trainer_scenarios.PLAN, 4)


@pytest.mark.parametrize("layout", ["fsdp2", "fsdp2_tp_loaded", "fsdp2_ep_loaded"])
def test_trainer_trains_in_fp8_like_the_single_process_reference(launched, layout):
    facts = scenarios.facts_of(launched, scenarios.key_of(trainer_scenarios.PLAN, "sc_trainer", {"layout": layout}))
    for f in facts:
        assert f["distributed_type"] == "FSDP" and f["mixed_precision"] == "fp8"
        if layout == "fsdp2_ep_loaded":
            _check_ep(f)
            continue
        if layout == "fsdp2_tp_loaded":
            assert [list(x) for x in f["mesh"]] == [["dp_shard", "tp"], [2, 2]]
        # every Linear but lm_head converted after sharding, FP8 on, the model Trainer trains is the prepared one
        assert len(f["converted"]) == 14 and f["skipped"] == ["lm_head"]
        assert f["fp8_enabled"] and f["prepared_is_trained"] and f["te_modules_fp8"] == [True]
        assert f["fp8_gemms_fwd"] == len(f["converted"]) * trainer_scenarios.STEPS and f["amax_reductions"] > 0
        assert f["amax_group_ranks"] == [0, 1, 2, 3]
        assert f["epochs"] == [1.0, 2.0, 3.0]  # each step took the whole data set: the reference's full batch
        # FSDP2 from the config computes in bf16 (accelerate's FSDP2 policy for fp8): losses within bf16
        # resolution; the N-D model keeps transformers' fp32 policy: step 0 to FP8 summation-order noise
        rel0 = 2e-3 if layout == "fsdp2" else 2e-4
        assert f["losses"][0] == pytest.approx(f["reference"][0], rel=rel0)
        assert f["losses"] == pytest.approx(f["reference"], rel=1e-2)
        # the clipped grad norm (before clipping, as Trainer logs it; CLIP acts at every step)
        assert min(f["reference_grad_norms"]) > trainer_scenarios.CLIP
        assert f["grad_norms"] == pytest.approx(f["reference_grad_norms"], rel=3e-2)
    assert len({tuple(f["losses"]) for f in facts}) == 1  # every rank logs the same mean


def test_use_cpu_with_an_fsdp2_config_warns_naming_what_is_dropped(launched):
    facts = scenarios.facts_of(launched, "sc_trainer_use_cpu")
    for rank, f in enumerate(facts):
        assert f["distributed_type"] == "MULTI_CPU" and not f["is_fsdp2"] and not f["fixes_prepare"]
        assert len(f["warnings"]) == (1 if rank == 0 else 0), f["warnings"]  # one voice: rank 0
    message = facts[0]["warnings"][0]
    assert "TrainingArguments(use_cpu=True)" in message and "MULTI_CPU (DDP)" in message
    assert "drops the FSDP2 plugin" in message and "fixes are off" in message and "FP8 is not applied" in message
    assert "remove use_cpu=True" in message


def _check_ep(f):
    """A Qwen3-MoE loaded with transformers' expert parallelism (fsdp 4 x ep 2) through Trainer: every Linear but
    lm_head and both experts modules in FP8, losses and clipped norms like one process (issue 30 item 1)."""
    assert f["experts"] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert len(f["converted"]) == 8 and f["skipped"] == ["lm_head"]  # q, k, v, o of 2 layers; routers are no Linear
    # forward and backward amax reductions each step, on the whole mesh and on the experts' replica group
    assert f["amax_reductions"] == 4 * trainer_scenarios.STEPS
    assert f["fp8_enabled"] and f["prepared_is_trained"] and f["te_modules_fp8"] == [True]
    assert f["epochs"] == [1.0, 2.0, 3.0]
    assert f["losses"][0] == pytest.approx(f["reference"][0], rel=2e-4)
    assert f["losses"] == pytest.approx(f["reference"], rel=1e-2)
    assert min(f["reference_grad_norms"]) > trainer_scenarios.CLIP
    assert f["grad_norms"] == pytest.approx(f["reference_grad_norms"], rel=3e-2)
