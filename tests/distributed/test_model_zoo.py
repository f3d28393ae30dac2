"""Model zoo on 4 CPU ranks: the model families users train (transformers' own classes, tiny configs) on
FSDP2, TP, FSDP2 x TP and HSDP, in FP8 through the patched prepare (Transformer Engine's real Python on CPU).

Each scenario trains 3 steps and is compared with the same model trained in one process: losses, the
clipped grad norm, and the step-0 gradient of every 1-D parameter (norm weights, biases) — the check that
catches a replicated parameter whose gradient is only this rank's part (Qwen3's per-head q_norm / k_norm
under TP, A15). FSDP2 x TP runs every family and round-trips a checkpoint bit for bit.

The suite runs the layouts that differ per family; ``ACCEL_FP8_FIX_ZOO=full`` runs every family on every
layout (what docs/compatibility.md records).
"""

import json
import os
import subprocess
import sys

import pytest

from support import scenarios
from support import tolerances
from support import zoo_scenarios

FULL = os.environ.get("ACCEL_FP8_FIX_ZOO") == "full"
# FSDP2 x TP for every family (with a checkpoint round trip); TP where families differ (norms inside
# attention, fused projections, MoE); FSDP2 / HSDP once each beyond Llama (tested in test_fsdp2_fp8.py);
# and Qwen3 FSDP2 x TP without FP8, where gradients must equal the reference exactly.
PLAN_2D = [("sc_zoo", {"family": f, "layout": "fsdp2_tp", "out_dir": None}) for f in zoo_scenarios.FAMILIES] + [
    ("sc_zoo", {"family": "llama", "layout": "fsdp2_tp_loaded", "out_dir": None})]  # N-D loading (A18), as the demo
PLAN_OTHER = (
    [("sc_zoo", {"family": f, "layout": l}) for l in ("fsdp2", "tp", "hsdp") for f in zoo_scenarios.FAMILIES]
    if FULL else
    [("sc_zoo", {"family": f, "layout": "tp"}) for f in ("qwen3", "gemma3", "phi3", "qwen3_moe", "exaone4")]
    + [("sc_zoo", {"family": "exaone4", "layout": "tp", "precision": "no"})]
    + [("sc_zoo", {"family": "qwen2", "layout": "fsdp2"}), ("sc_zoo", {"family": "qwen3_moe", "layout": "hsdp"})]
) + [("sc_zoo", {"family": "qwen3", "layout": "fsdp2_tp", "precision": "no"}),
      ("sc_zoo", {"family": "qwen3", "layout": "fsdp2_tp_loaded"})]  # transformers' own grad all-reduce style, 2-D

class _Zoo:
    """Both launches' results; a case's facts are read by its own test, so a scenario that raised fails that
    test alone (with the rank's traceback), not every case of the launch."""

    def __init__(self, ckpt_dir):
        plan_2d = [(n, {**kw, "out_dir": ckpt_dir}) for n, kw in PLAN_2D]
        self.where = {"mesh_mismatch": (scenarios.launch(zoo_scenarios, PLAN_OTHER + [("sc_loaded_mesh_mismatch", {})], 4),
                                        "sc_loaded_mesh_mismatch")}
        for plan, launched in ((plan_2d, scenarios.launch(zoo_scenarios, plan_2d, 4)), (PLAN_OTHER, self.where["mesh_mismatch"][0])):
            for name, kwargs in plan:
                case = (kwargs["family"], kwargs["layout"], kwargs.get("precision", "fp8"))
                self.where[case] = (launched, scenarios.key_of(plan, name, kwargs))

    def __getitem__(self, case):
        return scenarios.facts_of(*self.where[case])


@pytest.fixture(scope="module")
def zoo(ckpt_dir):
    return _Zoo(ckpt_dir)


# Exaone4 under TP 4 in FP8 (one head a rank): its step-0 loss is 4.5e-4 off the one-process FP8 reference (2e-4
# allowed) and layer 0's post_feedforward_layernorm gradient 54 % (35 % allowed), deterministically; exact without
# FP8 (the case beside it) and under FSDP2 x TP 2 — an open finding (CHANGELOG, transformers 5.25), not widened
OPEN = {("exaone4", "tp", "fp8"): "Exaone4 FP8 under TP 4 deviates at step 0 (open finding)"}


def _cases():
    cases = [(kw["family"], kw["layout"], "fp8") for _, kw in PLAN_2D]
    cases += [(kw["family"], kw["layout"], kw.get("precision", "fp8")) for _, kw in PLAN_OTHER]
    return [pytest.param(*c, marks=pytest.mark.xfail(strict=True, reason=OPEN[c])) if c in OPEN else c for c in cases]


@pytest.mark.parametrize("family,layout,precision", _cases(), ids=lambda v: str(v))
def test_family_trains_like_the_single_process_reference(zoo, family, layout, precision):
    fp8 = precision == "fp8"
    for f in zoo[(family, layout, precision)]:
        assert f["params_are_leaves"]
        if fp8:
            # every Linear but lm_head in FP8 — Phi3's fused projections under TP too (TE's column / row mode
            # plus the gather / split of transformers' colwise_gather_output / rowwise_split_input)
            assert f["converted"] == f["reference_converted"] and f["converted"]
            experts = [f"model.layers.{i}.mlp.experts" for i in (0, 1)] if family == "qwen3_moe" else []
            linears = len(f["converted"]) * zoo_scenarios.STEPS
            if experts and f["experts_expected"]:  # packed experts on TE grouped GEMMs: one FP8 GEMM an expert hit
                assert f["experts"] == experts and list(f["skipped"]) == ["lm_head"]
                assert linears < f["fp8_gemms_fwd"] <= linears + 2 * 4 * len(experts) * zoo_scenarios.STEPS
            else:  # Qwen3-MoE under TP 4: 8 expert rows a rank, below FP8's 16: kept, named (the reference too)
                assert f["experts"] == [] and list(f["skipped"]) == ["lm_head", *experts]
                assert all("multiples of 16" in f["skipped"][e] for e in experts)
                assert f["fp8_gemms_fwd"] == linears
            assert f["fp8_enabled"]
            assert f["fp8_state_identical_every_step"] == [True] * zoo_scenarios.STEPS
            # the rehearsal's fast-accumulation model ran every forward FP8 GEMM it applies to, or none when off
            assert (f["fast_accum_gemms"] > 0) == (tolerances.fast_accum_on() and f["recipe"] in ("DelayedScaling", "Float8CurrentScaling"))
        # step 0 agrees to FP8 summation-order noise (exactly without FP8), plus under the fast-accumulation model
        # what TP's split K adds (tests/support/tolerances.py); later steps within FP8 resolution
        step0 = tolerances.step0_rel(2e-4, zoo_scenarios.LAYOUTS[layout][2] or 1, f["row_parallel_ks"]) if fp8 else 1e-6
        assert f["losses"][0] == pytest.approx(f["reference"][0], rel=step0)
        assert f["losses"] == pytest.approx(f["reference"], rel=1e-2 if fp8 else 1e-6)
        # (Gemma3 under TP drifts to ~2.3% by step 2 in FP8; exact without FP8. A norm missing a mesh
        # dim's reduction is off by tens of percent)
        assert f["grad_norms"] == pytest.approx(f["reference_grad_norms"], rel=3e-2 if fp8 else 1e-5)
        # every 1-D parameter's full gradient: FP8 (E5M2 gradients) moves single elements by up to ~20%; a
        # gradient missing the other TP ranks' share is off by ~75% (3 of 4 heads' contributions)
        errors = f["small_param_grad_rel_errors"]
        assert errors and None not in errors.values(), errors
        assert max(errors.values()) < (0.35 if fp8 else 1e-5), errors


@pytest.mark.parametrize("family,layout", [(f, "fsdp2_tp") for f in zoo_scenarios.FAMILIES] + [("llama", "fsdp2_tp_loaded")])
def test_fsdp2_x_tp_checkpoint_round_trips_bit_for_bit(zoo, family, layout):
    for f in zoo[(family, layout, "fp8")]:
        # qwen3_moe: its TP-packed experts (gate_up_proj, _StridedShard on tp) written one chunk per row range (A16)
        assert "checkpoint_refused" not in f, f["checkpoint_refused"]
        # saved after an evaluation pass (no FP8 in eval): the FP8 state must still be in the checkpoint (A19)
        assert f.get("checkpoint_load_error") is None, f["checkpoint_load_error"]
        assert f["checkpoint_param_mismatch"] == [] and f["checkpoint_fp8_mismatch"] == []
        assert f["checkpoint_fp8_compared"] > 0 and f["converted"]  # FP8 state (scales, amax histories) too


EXPORT_LOAD = """
import json, sys
import torch
from transformers import AutoModelForCausalLM

out = {"imported": sorted(m for m in ("accel_fp8_fix", "transformer_engine") if m in sys.modules)}
for export in sys.argv[1:]:
    model, info = AutoModelForCausalLM.from_pretrained(export, output_loading_info=True)
    trained = torch.load(export + ".trained.pt", weights_only=True)
    state = model.state_dict()
    out[export] = {
        "missing": sorted(info["missing_keys"]), "unexpected": sorted(info["unexpected_keys"]),
        "mismatched": sorted(str(m) for m in info["mismatched_keys"]),
        "differs": sorted(k for k, t in trained.items() if k not in state or state[k].dtype != t.dtype
                          or not torch.equal(state[k], t)),
        "compared": len(trained),
    }
out["imported_after"] = sorted(m for m in ("accel_fp8_fix", "transformer_engine") if m in sys.modules)
print(json.dumps(out))
"""


def test_save_model_exports_what_plain_transformers_loads(zoo, ckpt_dir):
    """``save_model`` of every FSDP2 x TP family trained in FP8 (after its checkpoint round trip), loaded by
    plain transformers in a clean process without this package or Transformer Engine: no missing, unexpected
    (``_extra_state``) or mismatched key, and every weight equal to the trained full weight, dtype included."""
    exports = []
    for family, layout in [(f, "fsdp2_tp") for f in zoo_scenarios.FAMILIES] + [("llama", "fsdp2_tp_loaded")]:
        facts = zoo[(family, layout, "fp8")][0]
        assert facts.get("checkpoint_load_error") is None
        if family == "qwen3_moe" and scenarios.torch_below(12):  # DTensor < 2.12 cannot gather the TP-packed experts
            assert "shard_order" in (facts.get("export_error") or ""), facts.get("export_error")
            continue  # (a torch limitation; the pure-TP case is a strict xfail in test_tp_checkpoint.py)
        assert facts.get("export_error") is None, facts["export_error"]
        exports.append(os.path.join(ckpt_dir, f"{family}-{layout}-export"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_FP8_FIX", "ACCELERATE_"))}
    env["ACCEL_FP8_FIX"] = "0"
    out = subprocess.run([sys.executable, "-c", EXPORT_LOAD, *exports], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["imported"] == [] and got["imported_after"] == [], got
    for export in exports:
        r = got[export]
        assert (r["missing"], r["unexpected"], r["mismatched"], r["differs"]) == ([], [], [], []), (export, r)
        assert r["compared"] > 10, r


def test_a_model_sharded_at_load_with_other_sizes_is_refused_by_name(zoo):
    for f in zoo["mesh_mismatch"]:
        assert f["error"] is not None and f["te_modules"] == 0  # refused before any conversion
        assert f["error"].startswith("accel_fp8_fix: model.embed_tokens.weight was sharded before prepare on mesh")
        assert "'tp' has 4 ranks (ParallelismConfig: 2)" in f["error"] and "DistributedConfig(tp_size=2, fsdp_size=2)" in f["error"]
