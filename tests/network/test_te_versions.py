"""An older Transformer Engine than the venv's, under the same FSDP2 FP8 scenarios: TE 2.8.0.

Chosen because it is the last release whose FP8 context is only ``fp8_autocast(fp8_recipe=,
fp8_group=)`` (``autocast(recipe=, amax_reduction_group=)`` arrived in 2.9), with ``FP8GlobalStateManager``
in ``pytorch/fp8.py`` and ``Float8TensorBase`` in ``tensor/_internal`` — the 2.x line of the torch 2.8/2.9
era that deployed containers carry (which exact TE each NGC container ships was not verified here). Its pure-Python wheel is installed
(``pip install --no-deps --target``, cached like the accelerate releases) and shadows the venv's TE
through ``PYTHONPATH`` in every rank; TE's own Python then runs over the CPU kernel shim.
"""

from __future__ import annotations

import pytest

from support import fp8_scenarios
from support import scenarios
from support import versions

TE_VERSION = "2.8.0"


@pytest.fixture(scope="module")
def older(tmp_path_factory):
    directory = versions.require(TE_VERSION, package="transformer-engine")
    out_dir = str(tmp_path_factory.mktemp("ckpt-te"))
    plan = [("sc_te_version", {}), ("sc_fsdp2_fp8_train", {}), ("sc_checkpoint_save", {"out_dir": out_dir}),
            ("sc_checkpoint_load", {"out_dir": out_dir})]
    return directory, scenarios.launch(fp8_scenarios, plan, 2, env={**scenarios.ENV_FIXED, "PYTHONPATH": directory})


def test_ranks_ran_the_older_te_python(older):
    directory, results = older
    for f in scenarios.facts_of(results, "sc_te_version"):
        assert f["version"] == TE_VERSION and f["file"].startswith(directory)
        assert not f["has_autocast"]  # the fix drives fp8_autocast(fp8_recipe=, fp8_group=) here


def test_fsdp2_fp8_training_on_the_older_te(older):
    _, results = older
    facts = scenarios.facts_of(results, "sc_fsdp2_fp8_train")
    for f in facts:
        assert f["fp8_enabled"] and f["skipped"] == []
        fp8_scenarios.check_fp8_gemms(f)
        assert f["amax_reductions"] == 2 * fp8_scenarios.STEPS and f["fp8_group_is_amax_group"]
        assert f["fp8_state_identical_every_step"] == [True] * fp8_scenarios.STEPS
        fp8_scenarios.check_losses(f, facts[0]["reference"])


def test_checkpoint_round_trip_on_the_older_te(older):
    _, results = older
    for f in scenarios.facts_of(results, "sc_checkpoint_load"):
        assert f["missing"] == [] and f["mismatched"] == [] and f["fp8_mismatched"] == []
        assert f["fp8_compared"] == 20 and f["fp8_nontrivial"] > 0
