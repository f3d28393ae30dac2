"""Patch engine: selection by version, all-or-nothing, idempotence, exact undo, foreign wrappers."""

import importlib
import subprocess
import sys
import warnings

import pytest
import wrapt

from support import engine_targets as targets
from accel_fp8_fix.engine import (
    DeclarationError,
    Engine,
    FixWrapper,
    PatchError,
    load_patch_sets,
    select_patch_set,
)
from accel_fp8_fix.engine.declarations import parse_patch_set

RUN = "support.engine_targets:Engine.run"
HELPER = "support.engine_targets:helper"


def make_set(patches, name="test-set", requires=None, compatible=None, kind="fix"):
    return parse_patch_set(
        {
            "name": name,
            "kind": kind,
            "requires": requires or {},
            "compatible": compatible or {},
            "patch": patches,
        }
    )


def window(name, accelerate, torch=">=2.6", **extra):
    return make_set(
        [{"target": HELPER, "wrapper": "support.engine_targets:add_ten"}],
        name=name,
        requires={"accelerate": accelerate, "torch": torch},
        **extra,
    )


WINDOWS = [
    window("old", ">=1.6,<1.8"),
    window("mid", ">=1.8,<1.13"),
    window("new", ">=1.13,<1.16", compatible={"transformer-engine": ">=1.12"}),
]


@pytest.mark.parametrize(
    "accelerate,expected",
    [
        ("1.6.0", "old"),
        ("1.7.99", "old"),
        ("1.8.0", "mid"),  # lower edge is inclusive
        ("1.12.1", "mid"),
        ("1.13.0", "new"),
        ("1.15.0", "new"),
        ("1.15.0.dev0", "new"),  # pre-releases inside a window count
        ("1.16.0", None),  # upper edge is exclusive
        ("1.16.0.dev0", None),
        ("1.5.0", None),
    ],
)
def test_selection_by_accelerate_version(accelerate, expected):
    sel = select_patch_set(WINDOWS, versions={"accelerate": accelerate, "torch": "2.13.0+cpu"})
    assert (sel.patch_set.name if sel.patch_set else None) == expected
    if expected is None:
        assert "unsupported versions" in sel.reason
        assert f"accelerate {accelerate}" in sel.reason
        assert "new: [" in sel.reason  # the message lists the supported windows


def test_selection_requires_installed_and_checks_compatible_only_when_present():
    no_torch = select_patch_set(WINDOWS, versions={"accelerate": "1.14.0", "torch": None})
    assert no_torch.patch_set is None and "torch not installed" in no_torch.reason
    te_missing = select_patch_set(WINDOWS, versions={"accelerate": "1.14.0", "torch": "2.13.0"})
    assert te_missing.patch_set.name == "new"
    te_old = select_patch_set(
        WINDOWS, versions={"accelerate": "1.14.0", "torch": "2.13.0", "transformer-engine": "1.11.0"}
    )
    assert te_old.patch_set is None and "transformer-engine 1.11.0" in te_old.reason
    te_emulated = select_patch_set(
        WINDOWS, versions={"accelerate": "1.14.0", "torch": "2.13.0", "transformer_engine": "2.20.0+emulated"}
    )
    assert te_emulated.patch_set.name == "new"


def test_overlapping_windows_are_a_declaration_error_and_select_nothing():
    overlapping = WINDOWS + [window("rogue", ">=1.14,<1.15")]
    sel = select_patch_set(overlapping, versions={"accelerate": "1.14.0", "torch": "2.13.0"})
    assert sel.patch_set is None
    assert "windows overlap" in sel.reason and "new" in sel.reason and "rogue" in sel.reason
    # Outside the overlap the rule still picks the single match.
    assert select_patch_set(overlapping, versions={"accelerate": "1.13.0", "torch": "2.13.0"}).patch_set.name == "new"


def test_declarations_shipped_in_repo_parse_and_do_not_overlap():
    sets = load_patch_sets()
    assert any(s.kind == "fix" for s in sets)
    for kind in {s.kind for s in sets}:
        for version in ("1.13.0", "1.14.0", "1.15.0"):
            sel = select_patch_set(sets, kind, versions={"accelerate": version, "torch": "2.13.0"})
            assert "overlap" not in sel.reason


@pytest.mark.parametrize(
    "bad,message",
    [
        ({"name": "x", "patch": []}, "declares no patch"),
        ({"name": "x", "patch": [{"target": "nocolon", "wrapper": "a:b"}]}, "must look like"),
        ({"name": "x", "patch": [{"target": "a:b"}]}, r"needs a wrapper or notes"),
        ({"name": "x", "patch": [{"target": "a:b", "notes": "b"}]}, "declares no on_error"),
        ({"name": "x", "on_error": "nocolon", "patch": [{"target": "a:b", "notes": "b"}]}, "must look like"),
        ({"name": "x", "patch": [{"target": "a:b", "wrapper": "a:c", "on_return": "x"}]}, "must look like"),
        ({"name": "x", "kind": "other", "patch": [{"target": "a:b", "wrapper": "a:b"}]}, "kind must be"),
        ({"name": "x", "requires": {"accelerate": "~~1"}, "patch": [{"target": "a:b", "wrapper": "a:b"}]}, "invalid"),
    ],
)
def test_malformed_declarations_are_rejected_with_the_reason(bad, message):
    with pytest.raises(DeclarationError, match=message):
        parse_patch_set(bad)


@pytest.fixture
def fresh_targets():
    """Reload the stand-in library so every test starts from pristine attributes."""
    module = importlib.reload(targets)
    yield module
    importlib.reload(targets)


def test_apply_wraps_with_our_marker_and_undo_restores_the_exact_object(fresh_targets):
    original_run = fresh_targets.Engine.__dict__["run"]
    original_helper = fresh_targets.helper
    engine = Engine(
        make_set(
            [
                {"target": RUN, "wrapper": "support.engine_targets:double_result", "signature": "(self, x, *, scale=1)"},
                {"target": HELPER, "wrapper": "support.engine_targets:add_ten"},
            ]
        )
    )
    engine.activate(strict=True)  # module already imported: applied immediately
    assert isinstance(fresh_targets.Engine.__dict__["run"], FixWrapper)
    assert fresh_targets.Engine().run(3, scale=2) == 12
    assert fresh_targets.helper(1) == 12
    assert [s.status for s in engine.states] == ["applied", "applied"]

    engine.deactivate()
    assert fresh_targets.Engine.__dict__["run"] is original_run
    assert fresh_targets.helper is original_helper
    assert fresh_targets.Engine().run(3, scale=2) == 6


def test_a_signature_list_accepts_any_release_of_the_window(fresh_targets):
    """One declaration per window: releases that spell the same parameters differently (1.15 annotates the
    return, 1.13 does not) are listed; anything else is refused, naming every accepted one."""
    ok = Engine(make_set([{"target": RUN, "wrapper": "support.engine_targets:double_result",
                           "signature": ["(self, y)", "(self, x, *, scale=1)"]}]))
    ok.activate(strict=True)
    assert fresh_targets.Engine().run(3, scale=2) == 12
    ok.deactivate()
    bad = Engine(make_set([{"target": RUN, "wrapper": "support.engine_targets:double_result",
                            "signature": ["(self, y)", "(self, z)"]}]))
    with pytest.raises(PatchError, match=r"expected \(self, y\) or \(self, z\), found \(self, x, \*, scale=1\)"):
        bad.apply()
    assert not isinstance(fresh_targets.Engine.__dict__["run"], FixWrapper)


def test_activate_twice_patches_once(fresh_targets):
    engine = Engine(make_set([{"target": HELPER, "wrapper": "support.engine_targets:add_ten"}]))
    engine.activate(strict=True)
    engine.activate(strict=True)
    engine.apply()
    assert fresh_targets.helper(0) == 11  # not 21
    assert not isinstance(fresh_targets.helper.__wrapped__, FixWrapper)
    # A second engine for the same target refuses rather than stacking.
    other = Engine(make_set([{"target": HELPER, "wrapper": "support.engine_targets:add_ten"}], name="other"))
    with pytest.raises(PatchError, match="already wrapped by patch set 'test-set'"):
        other.apply()
    engine.deactivate()


@pytest.mark.parametrize(
    "broken,reason",
    [
        ({"target": "support.engine_targets:Engine.missing", "wrapper": "support.engine_targets:add_ten"}, "no attribute 'missing'"),
        ({"target": "_no_such_module_xyz:f", "wrapper": "support.engine_targets:add_ten"}, "ModuleNotFoundError"),
        ({"target": RUN, "wrapper": "support.engine_targets:add_ten", "signature": "(self, x)"}, "signature changed"),
        ({"target": RUN, "wrapper": "support.engine_targets:NOT_CALLABLE"}, "not callable"),
        ({"target": RUN, "wrapper": "support.engine_targets:nope"}, "has no attribute 'nope'"),
    ],
)
def test_all_or_nothing_when_one_patch_is_broken(fresh_targets, broken, reason):
    original_helper = fresh_targets.helper
    original_run = fresh_targets.Engine.__dict__["run"]
    engine = Engine(make_set([{"target": HELPER, "wrapper": "support.engine_targets:add_ten"}, broken]))
    with pytest.raises(PatchError, match=reason) as info:
        engine.apply()
    assert "left untouched" in str(info.value) and broken["target"] in str(info.value)
    assert fresh_targets.helper is original_helper
    assert fresh_targets.Engine.__dict__["run"] is original_run
    assert [s.status for s in engine.states] == ["pending", "failed"]
    # Non-strict activation reports with a warning instead of raising, and still patches nothing.
    with pytest.warns(RuntimeWarning, match="not applied"):
        engine.activate(strict=False)
    assert fresh_targets.helper is original_helper


def test_inherited_attribute_is_refused():
    class Child(targets.Engine):
        pass

    sys.modules["_engine_child"] = type(sys)("_engine_child")
    sys.modules["_engine_child"].Child = Child
    engine = Engine(make_set([{"target": "_engine_child:Child.run", "wrapper": "support.engine_targets:add_ten"}]))
    with pytest.raises(PatchError, match="of its own"):
        engine.apply()


def test_foreign_wrapper_on_top_is_kept_and_ours_becomes_pass_through(fresh_targets):
    engine = Engine(make_set([{"target": HELPER, "wrapper": "support.engine_targets:add_ten"}]))
    engine.activate(strict=True)

    def foreign(wrapped, instance, args, kwargs):
        return wrapped(*args, **kwargs) * 100

    wrapt.wrap_function_wrapper(fresh_targets, "helper", foreign)
    theirs = fresh_targets.helper
    assert theirs(0) == 1100  # (0 + 1 + 10) * 100

    with pytest.warns(RuntimeWarning, match="wrapped again after us"):
        engine.deactivate()
    assert fresh_targets.helper is theirs  # not clobbered
    assert theirs(0) == 100  # ours passes straight through now
    assert engine.states[0].status == "disabled-in-place"

    engine.activate(strict=True)  # re-enabling reuses our wrapper under theirs, never stacks a second one
    assert theirs(0) == 1100
    engine.deactivate()


def test_lazy_apply_on_import_of_the_trigger(tmp_path, monkeypatch):
    (tmp_path / "_lazy_lib.py").write_text("def f():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    engine = Engine(make_set([{"target": "_lazy_lib:f", "wrapper": "support.engine_targets:add_ten"}]))
    engine.activate(strict=True)
    assert "_lazy_lib" not in sys.modules and engine.states[0].status == "pending"
    import _lazy_lib

    assert _lazy_lib.f() == 11 and engine.states[0].status == "applied"
    engine.deactivate()
    assert _lazy_lib.f() == 1
    sys.modules.pop("_lazy_lib")


def test_inactive_engine_ignores_its_import_hook(tmp_path, monkeypatch):
    (tmp_path / "_lazy_lib2.py").write_text("def f():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    engine = Engine(make_set([{"target": "_lazy_lib2:f", "wrapper": "support.engine_targets:add_ten"}]))
    engine.activate()
    engine.deactivate()
    import _lazy_lib2

    assert _lazy_lib2.f() == 1
    sys.modules.pop("_lazy_lib2")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine.deactivate()  # undo of nothing is fine


# -- internals fenced, upstream sources pinned (real accelerate / torch, in a fresh interpreter) ----------

_PROBE = """
import json, sys
{tamper}
import accel_fp8_fix, accelerate, accelerate.accelerator as A
from accel_fp8_fix.engine import FixWrapper
r = accel_fp8_fix.report()
print(json.dumps({{"patch_set": accel_fp8_fix.active_patch_set(), "error": r.error,
                  "prepare_wrapped": isinstance(vars(A.Accelerator)["prepare"], FixWrapper)}}))
"""


def _probe(tamper: str) -> dict:
    import json
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_FP8_FIX", "ACCELERATE_FP8"))}
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", _PROBE.format(tamper=tamper)], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_untampered_internals_let_the_set_apply():
    got = _probe("")
    assert got["patch_set"] == "accelerate-1.13-1.16" and got["error"] == "" and got["prepare_wrapped"]


def test_a_renamed_private_internal_refuses_the_whole_set_naming_it_and_the_version():
    from accel_fp8_fix.engine import installed_version

    # a torch whose FSDP2 no longer records which module owns a parameter
    tamper = "import accel_fp8_fix.internals.torch_fsdp2 as f; f._SOURCES += (('_fsdp_param.py', 'self._module_info_renamed'),)"
    got = _probe(tamper)
    assert got["patch_set"] is None and not got["prepare_wrapped"]  # accelerate untouched
    assert "internal 'self._module_info_renamed' is gone from _fully_shard/_fsdp_param.py" in got["error"]
    assert f"torch {installed_version('torch')}" in got["error"]
    assert "not applied (accelerate left untouched" in got["error"]


def test_a_changed_upstream_body_that_the_set_mirrors_refuses_it_naming_the_function():
    # another body under the same name (a release that rewrote it)
    tamper = "import accelerate.utils.transformer_engine as t; t.apply_fp8_autowrap = t.convert_model"
    got = _probe(tamper)
    assert got["patch_set"] is None and not got["prepare_wrapped"]
    assert "accelerate.utils.transformer_engine:apply_fp8_autowrap changed upstream" in got["error"]
