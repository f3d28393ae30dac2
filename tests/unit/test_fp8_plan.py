"""One place per decision (issue 29 item 3): a patched ``prepare`` chooses the TE recipe, builds it and decides the
FP8 all-gather once (fixes/convert/fp8_plan.py), and the later steps read the plan. Counted here on the prepare path a
single process can run: ``prepare`` -> ``plan_fp8`` -> the stock prepare (a stub) -> ``finish_fp8_prepare``, the
steps that need sharded TE modules replaced by recorders."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
from torch import nn

from accel_fp8_fix.rehearsal import te_on_cpu

te_on_cpu.install()  # TE's real Python (its recipe classes) over the CPU kernel shim

from accel_fp8_fix.fixes.all_gather import fp8_all_gather  # noqa: E402
from accel_fp8_fix.fixes.convert import fp8_plan  # noqa: E402
from accel_fp8_fix.fixes.start import fp8_all_gather_policy, handler_choices  # noqa: E402
from accel_fp8_fix.fixes import prepare as prepare_fix  # noqa: E402
from accel_fp8_fix.fixes.start import recipes  # noqa: E402
from accel_fp8_fix.fixes.convert import run_state  # noqa: E402
from accel_fp8_fix.fixes.start.recipe_kwargs import te_recipe_kwargs  # noqa: E402
from accel_fp8_fix.fixes.convert.te_convert import ConversionReport  # noqa: E402


class _Counted:
    def __init__(self, monkeypatch, module, name):
        self.calls, original = 0, getattr(module, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)


class _TEModule(nn.Linear):
    def init_fp8_metadata(self, num_gemms=1):
        self.initialised = num_gemms


class _Accelerator(SimpleNamespace):
    __hash__ = object.__hash__  # the package keeps a record per accelerator (fixes/convert/run_state.py)


def _accelerator(handler):
    accelerator = _Accelerator(te_recipe_handler=handler, is_fsdp2=True, state=SimpleNamespace(fsdp_plugin=None),
                               parallelism_config=None)
    run_state.record(accelerator).agreed = True  # no patch-set agreement round: no process group here
    return accelerator


@pytest.fixture
def patched_prepare(monkeypatch):
    """prepare's steps that need a sharded model and real TE modules, recorded instead; returns what they saw."""
    seen = {}
    module = _TEModule(4, 4)
    monkeypatch.setattr(prepare_fix, "handles_fp8_prepare", lambda accelerator: True)
    monkeypatch.setattr(prepare_fix, "record_tp_layout", lambda model: None)
    monkeypatch.setattr(prepare_fix, "convert_after_sharding",
                        lambda model, te, dim_multiple: ConversionReport(converted=["0"], te_modules=[module]))
    monkeypatch.setattr(prepare_fix, "gemms_per_forward", lambda module: 1)
    monkeypatch.setattr(fp8_all_gather, "install",
                        lambda model, te_modules, recipe, group: seen.setdefault("all_gather", recipe))
    monkeypatch.setattr(prepare_fix, "register_tensor_state", lambda model, te_modules, attrs: [])
    monkeypatch.setattr(prepare_fix, "install_safe_loading", lambda module: None)
    monkeypatch.setattr(prepare_fix, "keep_fp8_state_in_checkpoints", lambda module: None)
    monkeypatch.setattr(prepare_fix, "wrap_forward", lambda model, te, recipe, group, during_eval: seen.setdefault("fwd", recipe))
    monkeypatch.setattr(prepare_fix, "route_checkpointing_through_te", lambda model: ([], []))
    return seen


@pytest.mark.parametrize("recipe,all_gather", [("delayed", None), ("current", "fp8"), ("block", "fp8"),
                                               ("block", "high_precision")])
def test_prepare_decides_the_recipe_and_the_all_gather_once(monkeypatch, patched_prepare, recipe, all_gather):
    accelerator = _accelerator(te_recipe_kwargs(recipe, all_gather=all_gather))  # (te_recipe_kwargs checks it too)
    resolved = _Counted(monkeypatch, recipes, "_chosen")  # every resolution of the handler's choice
    built = _Counted(monkeypatch, recipes, "build")  # every TE recipe construction
    switched = _Counted(monkeypatch, fp8_plan, "requested")  # every decision of the all-gather switch
    tiles = _Counted(monkeypatch, fp8_plan, "block_recipe_refusal")
    model = nn.Sequential(nn.Linear(4, 4))
    result = prepare_fix.prepare(lambda *args, **kwargs: args, accelerator, (model,), {})
    assert result == (model,)
    setup = accelerator.accel_fp8_fix
    assert setup.fp8_enabled and setup.recipe is patched_prepare["fwd"]
    assert (resolved.calls, built.calls, switched.calls) == (1, 1, 1)
    assert tiles.calls == (1 if (recipe, all_gather) == ("block", "fp8") else 0)
    assert ("all_gather" in patched_prepare) == (all_gather == "fp8")
    if all_gather == "fp8":
        assert patched_prepare["all_gather"] is setup.recipe  # the one recipe, the one the plan checked


def test_the_plan_is_frozen_and_reads_its_decisions_once(monkeypatch):
    built = _Counted(monkeypatch, recipes, "build")
    plan = fp8_plan.plan_fp8(_accelerator(te_recipe_kwargs("current", all_gather="fp8")))
    assert plan.all_gather and plan.all_gather_setting == "te_recipe_kwargs(all_gather)"
    assert plan.recipe_class == "Float8CurrentScaling" and plan.choice == ("current", "te_recipe_kwargs(recipe)")
    assert plan.recipe is plan.recipe and plan.use_during_eval is False and built.calls == 1
    with pytest.raises(AttributeError):
        plan.all_gather = False


def test_a_refused_all_gather_is_refused_by_the_plan_before_any_build(monkeypatch):
    built = _Counted(monkeypatch, recipes, "build")
    accelerator = _accelerator(te_recipe_kwargs("current", all_gather="fp8"))
    accelerator.is_fsdp2 = False
    with pytest.raises(fp8_all_gather_policy.Fp8AllGatherError, match="needs FSDP2"):
        fp8_plan.plan_fp8(accelerator)
    assert built.calls == 0


def test_the_handler_choice_is_found_by_identity_and_held_weakly():
    first, second = te_recipe_kwargs("current", all_gather="fp8"), te_recipe_kwargs("current")
    assert first == second  # equal dataclasses (and unhashable): only identity tells them apart
    assert handler_choices.all_gather_choice(first) == "fp8" and handler_choices.all_gather_choice(second) is None
    del first
    gc.collect()
    handler_choices.remember_choice(second, "current", {})  # a write drops the dead handlers' entries
    assert all(ref() is not None for ref, _choice in handler_choices._STORE._entries)
    assert handler_choices.choice_of(second).recipe == "current" and handler_choices.choice_of(None).recipe is None
