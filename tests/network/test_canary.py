"""The package's verified behaviour on whatever releases are installed: CI's canary runs this file in a venv of the
registry's newest torch, accelerate, transformers and Transformer Engine, resolved at run time
(``scripts/version_matrix.py --newest``), and then — when every one of them is inside its declared window — the
files that reach those libraries' internals. Here (the suite's venv) it checks the same promises on the pins.

The promises: inside every window, the set applies and every transformers feature is verified (a release inside a
window that breaks them is a red CI); a torch / accelerate / TE outside its window leaves accelerate untouched with
one warning naming it; a transformers outside its tested window keeps the set, and a model that uses a feature whose
source changed is refused by name at ``prepare`` — never a crash in backward — while one that uses only verified
features trains like one process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from accel_fp8_fix import _api
from accel_fp8_fix.internals import transformers_features
from support import scenarios
from support import zoo_scenarios

PROBE = """
import json, warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    import accel_fp8_fix, accelerate, accelerate.accelerator
    from accel_fp8_fix.engine import FixWrapper
    report = accel_fp8_fix.report()
print(json.dumps({"patch_set": report.patch_set, "reason": report.reason, "error": report.error,
                  "prepare_wrapped": isinstance(vars(accelerate.accelerator.Accelerator)["prepare"], FixWrapper),
                  "warnings": [str(w.message) for w in caught if "accel_fp8_fix" in str(w.message)]}))
"""


def _news(selection) -> list[str]:
    outside = [] if selection.patch_set is None else selection.patch_set.outside_tested(selection.versions)
    return outside + ([] if selection.supported else [selection.reason])


@pytest.fixture(scope="module")
def selection():
    chosen = _api.choose_patch_set("fix")
    news = _news(chosen)
    print("\ncanary: installed " + ", ".join(f"{k} {v}" for k, v in chosen.versions.items()))
    print("canary: " + ("NEWS: " + "; ".join(news) if news else "every release inside its declared window"))
    return chosen


def test_the_set_applies_inside_the_windows_and_stands_down_by_name_outside(selection):
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300,
                         env={**scenarios.ENV_FIXED, "ACCEL_FP8_FIX": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if selection.supported:
        assert got["patch_set"] == selection.patch_set.name and got["error"] == "" and got["prepare_wrapped"], got
    else:  # outside a torch / accelerate / TE window: accelerate untouched, said once, naming the release
        assert got["patch_set"] is None and not got["prepare_wrapped"], got
        (warning,) = [w for w in got["warnings"] if "nothing patched" in w]
        for name, version in selection.versions.items():
            if version and any(name in str(s.requires) for s in selection.candidates):
                assert f"{name} {version}" in warning, (name, warning)


def test_transformers_features_are_verified_inside_the_tested_window(selection):
    if selection.patch_set is None:
        pytest.skip("nothing patched: no feature is served")
    verdicts = transformers_features.verdicts(selection.versions)
    if not selection.patch_set.outside_tested(selection.versions):
        unverified = {n: v.problems for n, v in verdicts.items() if not v.verified}
        assert not unverified, f"a release inside the tested window changed what the package relies on: {unverified}"


def test_a_model_using_a_changed_feature_is_refused_by_name_never_in_backward(selection):
    """Qwen3 under FSDP2 x TP (4 ranks, FP8): its q_norm / k_norm need ``grad_allreduce``, its projections
    ``tp_styles``. Verified: it trains like one process (the zoo's check). Changed: ``prepare`` raises the
    refusal naming the feature, on every rank, before a step."""
    if selection.patch_set is None:
        pytest.skip("nothing patched (a release outside a window): stock accelerate runs")
    if os.environ.get("ACCEL_FP8_FIX_CANARY") != "1" and not _news(selection):
        pytest.skip("on the suite's pins the model zoo runs this case (tests/distributed/test_model_zoo.py); the "
                    "canary (scripts/version_matrix.py --newest) runs it on the registry's newest")
    verdicts = transformers_features.verdicts(selection.versions)
    plan = [("sc_zoo", {"family": "qwen3", "layout": "fsdp2_tp"})]
    results = scenarios.launch(zoo_scenarios, plan, 4)
    needed = ("grad_allreduce", "tp_styles")
    changed = [n for n in needed if not verdicts[n].verified]
    for rank, res in enumerate(results):
        facts = res["sc_zoo"]
        if changed:
            assert "scenario_error" in facts, f"rank {rank} trained on changed internals {changed}"
            assert facts["scenario_error"].startswith("UnverifiedInternalError: accel_fp8_fix: "), facts
            assert any(transformers_features.FEATURES[n][0] in facts["scenario_error"] for n in changed)
        else:
            assert "scenario_error" not in facts, facts
            assert facts["losses"] == pytest.approx(facts["reference"], rel=1e-2)
            assert facts["grad_norms"] == pytest.approx(facts["reference_grad_norms"], rel=3e-2)
