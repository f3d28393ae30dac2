"""Single-process checks of accel_fp8_fix.diagnostics: notes (3.11 and the 3.10 equivalent), the forward hook
that adds them without a frame, audit of plain-torch models (unconverted, stray state, mixed precondition,
coverage reasons), ``doctor --launch`` verdicts, and the import staying free of torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from accel_fp8_fix.diagnostics import notes
from accel_fp8_fix.diagnostics.audit import audit
from accel_fp8_fix.diagnostics.launch_check import check_launch_config
from accel_fp8_fix.fixes.convert import run_state

ROOT = Path(__file__).resolve().parents[2]
MIXED = ("aten.mul.Tensor got mixed torch.Tensor and DTensor, need to convert all torch.Tensor to DTensor before "
         "calling distributed operators!")
ENV = {k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_FP8_FIX", "ACCELERATE_"))}


class FakeAccelerator(SimpleNamespace):
    """An accelerator stand-in the package can keep a record for (identity-hashed, weakly referenced)."""

    __hash__ = object.__hash__


def _raise_mixed():
    raise RuntimeError(MIXED)


def test_import_stays_free_of_torch_and_audit_loads_on_first_use():
    code = ("import sys, accel_fp8_fix, accel_fp8_fix.diagnostics, accel_fp8_fix.distributed\n"
            "before = [m for m in ('torch', 'accelerate') if m in sys.modules]\n"
            "audit = accel_fp8_fix.audit\n"
            "print(before, audit.__module__, 'audit' in accel_fp8_fix.__all__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[]", "accel_fp8_fix.diagnostics.audit", "True"]


@pytest.mark.parametrize("message, kind", [
    (MIXED, "mixed"),
    ("Expected all inputs to be DTensor, but found a mixture of DTensor and Tensor", "mixed"),
    ("found no DeviceMesh from dtensor args for c10d.broadcast_.default!", "collective"),
    ("found no DeviceMesh from dtensor args for c10d::broadcast_", "collective"),  # torch 2.10's wording
    ("Operator c10d.broadcast_.default does not have a sharding strategy registered.", "collective"),
    ("FP8 execution requires the product of all dimensions except the last to be divisible by 8", "fp8_shape"),
    ("Refusing to load pickled Transformer Engine extra state for Linear. Delayed-scaling", "extra_state"),
    ("CUDA out of memory", None),
])
def test_classify(message, kind):
    assert notes.classify(RuntimeError(message)) == kind


def test_note_is_added_once_and_the_exception_is_the_same_object():
    try:
        with notes.explain_errors():
            with notes.explain_errors():  # nested: still one note
                _raise_mixed()
    except RuntimeError as exc:
        caught = exc
    assert type(caught) is RuntimeError and str(caught) == MIXED and caught.args == (MIXED,)
    assert len(caught.__notes__) == 1 and "accel_fp8_fix diagnosis" in caught.__notes__[0]
    assert traceback.extract_tb(caught.__traceback__)[-1].name == "_raise_mixed"
    assert "your own code" in caught.__notes__[0] and "in _raise_mixed" in caught.__notes__[0]


def test_unknown_errors_pass_untouched():
    with pytest.raises(KeyError) as info:
        with notes.explain_errors():
            raise KeyError("x")
    assert not hasattr(info.value, "__notes__")


def test_python_310_equivalent_keeps_type_object_and_traceback(monkeypatch):
    monkeypatch.setattr(notes, "HAS_ADD_NOTE", False)
    exc = RuntimeError(MIXED)
    try:
        raise exc
    except RuntimeError as e:
        tb = e.__traceback__
    notes.add_note(exc, "the note")
    assert type(exc) is RuntimeError and exc.__traceback__ is tb
    assert exc.__notes__ == ["the note"] and str(exc) == MIXED + "\nthe note"

    class Custom(RuntimeError):
        def __str__(self):
            return "custom"

    custom = Custom("a", "b")
    notes.add_note(custom, "n")
    assert custom.args == ("a", "b") and custom.__notes__ == ["n"]  # args left alone


def test_a_failing_diagnosis_never_replaces_the_error(monkeypatch):
    def broken(*a, **k):
        raise ValueError("diagnosis bug")

    monkeypatch.setattr(notes, "explain", broken)
    with pytest.raises(RuntimeError, match="got mixed") as info:
        with notes.explain_errors():
            _raise_mixed()
    assert not hasattr(info.value, "__notes__")


class _Failing(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) * _raise_mixed()


def test_forward_notes_come_from_torchs_own_except_without_adding_a_frame():
    plain = _Failing()
    with pytest.raises(RuntimeError) as stock:
        plain(torch.ones(1, 4))
    hooked = _Failing()
    notes.install_forward_notes(hooked)
    notes.install_forward_notes(hooked)  # idempotent
    assert len(hooked._forward_hooks) == 1
    with pytest.raises(RuntimeError) as noted:
        hooked(torch.ones(1, 4))
    def frames(e):
        return [(Path(f.filename).name, f.name) for f in traceback.extract_tb(e.__traceback__)]

    # the stock call takes torch's fast path (no hooks); the hooked one adds torch's own inner(), none of ours
    assert [f for f in frames(noted.value) if f != ("module.py", "inner")] == frames(stock.value)
    assert not any(name == "notes.py" for name, _ in frames(noted.value))
    assert str(noted.value) == str(stock.value) and "(forward)" in noted.value.__notes__[0]
    ok = nn.Linear(4, 4)
    notes.install_forward_notes(ok)
    assert ok(torch.ones(1, 4)).shape == (1, 4)  # inert on success


class _FakeTE(nn.Module):
    """TE-like state: tensors in a dict attribute (what TE's fp8_meta is), not parameters or buffers."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(16, 16))
        self.fp8_meta = {"scaling_fwd": SimpleNamespace(scale=torch.ones(3), amax_history=torch.zeros(4, 3))}


class _Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.ones(4, 16, 32))


class _Router(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4, 16))


def test_audit_of_an_unconverted_model_says_fp8_is_off_and_why():
    from transformers.pytorch_utils import Conv1D

    model = nn.Sequential()
    model.add_module("fc", nn.Linear(16, 32))
    model.add_module("conv1d", Conv1D(32, 16))
    model.add_module("experts", _Experts())
    model.add_module("router", _Router())
    model.add_module("emb", nn.Embedding(10, 16))
    report = audit(model)
    assert report.summary.startswith("FP8 OFF: no Transformer Engine module (4 Linear kept)")
    assert not report.fixes_prepared and report.amax_group_ranks is None and report.fp8_modules == []
    assert "not prepared by accel_fp8_fix" in report.module("fc").why_not
    reasons = dict(report.coverage.high_precision)
    assert set(reasons) == {"fc", "conv1d", "experts.gate_up_proj", "router"}
    assert "Conv1D" in reasons["conv1d"] and "3-D parameter" in reasons["experts.gate_up_proj"]
    assert reasons["router"].startswith("MoE router")
    c = report.coverage
    assert c.fp8_param_share == 0.0 and c.gemm_params == 16 * 32 + 32 * 16 + 4 * 16 * 32 + 4 * 16
    assert c.gemms_per_step == 3 * (1 + 1 + 4 + 1)  # forward, dgrad, wgrad; one per expert


def test_audit_names_stray_state_and_tied_weights_count_once():
    model = nn.Sequential(_FakeTE(), nn.Linear(16, 16), nn.Linear(16, 16))
    model[2].weight = model[1].weight  # tied
    report = audit(model)
    assert report.stray == ["0.fp8_meta.scaling_fwd.scale", "0.fp8_meta.scaling_fwd.amax_history"]
    assert report.coverage.gemm_params == 256  # the _FakeTE is not TE: not a GEMM module; the tied weight once
    assert "2 stray tensors" in report.summary and "0 mixed modules" in report.summary
    as_dict = report.as_dict()
    assert json.loads(json.dumps(as_dict, default=str))["coverage"]["fp8_param_share"] == 0.0


# -- doctor --launch -----------------------------------------------------------------------------------------
def _config(tmp_path, drop=(), **changes):
    import yaml

    cfg = yaml.safe_load((ROOT / "examples/fsdp2_tp_fp8.yaml").read_text())
    for dotted in drop:
        *parents, key = dotted.split(".")
        node = cfg
        for p in parents:
            node = node[p]
        del node[key]
    cfg.update(changes)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_doctor_launch_three_configs_three_verdicts(tmp_path):
    demo = check_launch_config(str(ROOT / "examples/fsdp2_tp_fp8.yaml"), environ={"ACCEL_FP8_FIX_REHEARSAL": "1"})
    assert demo.ok and demo.failed == [], str(demo)
    no_flag = check_launch_config(_config(tmp_path, drop=("fp8_config.accel_fp8_fix",)), environ={})
    assert not no_flag.ok and no_flag.failed == ["activation"]
    assert "fp8_config:\n  accel_fp8_fix: true" in [c.fix for c in no_flag.checks if c.name == "activation"]
    assert "[FAIL] activation: no fp8_config.accel_fp8_fix flag" in str(no_flag)
    wrong = check_launch_config(_config(tmp_path, num_processes=8), environ={})
    assert not wrong.ok and wrong.failed == ["process count"]
    (check,) = [c for c in wrong.checks if c.name == "process count"]
    assert "num_processes 8 but the parallelism sizes multiply to 4 (dp_shard 2 x tp 2)" in check.detail
    assert check.fix.startswith("num_processes: 4") and "parallelism_config_dp_shard_size: 4" in check.fix


def test_doctor_launch_other_checks(tmp_path):
    env = {"ACCEL_FP8_FIX_REHEARSAL": "1"}
    bf16 = check_launch_config(_config(tmp_path, mixed_precision="bf16"), environ=env)
    assert bf16.failed == ["mixed_precision"]
    fsdp1 = _config(tmp_path, fsdp_config={"fsdp_version": 1})
    assert check_launch_config(fsdp1, environ=env).failed == ["FSDP version"]
    old = check_launch_config(str(ROOT / "examples/fsdp2_tp_fp8.yaml"), environ=env,
                              versions={"accelerate": "1.10.0", "torch": "2.13.0", "transformer-engine": "2.20.2"})
    assert old.failed == ["versions"] and "accelerate 1.10.0" in str(old)
    no_te = check_launch_config(str(ROOT / "examples/fsdp2_tp_fp8.yaml"), environ=env,
                                versions={"accelerate": "1.15.0", "torch": "2.13.0", "transformer-engine": None})
    assert no_te.failed == ["Transformer Engine"]
    off = check_launch_config(str(ROOT / "examples/fsdp2_tp_fp8.yaml"), environ={**env, "ACCEL_FP8_FIX": "0"})
    assert off.failed == ["activation"] and "ACCEL_FP8_FIX=0" in str(off)


def test_doctor_cli(tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "accel_fp8_fix", "doctor", *args], capture_output=True,
                              text=True, env={**ENV, "ACCEL_FP8_FIX_REHEARSAL": "1"}, timeout=120, cwd=ROOT)

    ok = run("--launch", "examples/fsdp2_tp_fp8.yaml")
    assert ok.returncode == 0 and "verdict: WILL RUN Transformer Engine FP8 with accel_fp8_fix" in ok.stdout
    bad = run("--launch", _config(tmp_path, num_processes=3), "--json")
    assert bad.returncode == 1 and json.loads(bad.stdout)["failed"] == ["process count"]
    plain = run()  # the existing doctor output is unchanged
    assert plain.returncode == 0 and "patch set   : accelerate-1.13-1.16" in plain.stdout


def test_public_collectives_refuse_a_plain_tensor_without_a_mesh():
    from accel_fp8_fix.distributed import CollectiveError, all_gather, all_reduce, broadcast

    for fn in (broadcast, all_reduce, all_gather):
        with pytest.raises(CollectiveError, match="not promoted to a DTensor"):
            fn(torch.ones(2), name="grad")


def test_diagnostic_patches_apply_with_the_set():
    code = ("import json, accel_fp8_fix, accelerate, accelerate.accelerator\n"
            "r = accel_fp8_fix.report()\n"
            "print(json.dumps({p['target']: p['status'] for p in r.patches}))")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, env=ENV,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    status = json.loads(out.stdout.strip().splitlines()[-1])
    for target in ("accelerate.accelerator:Accelerator.backward", "accelerate.accelerator:Accelerator.clip_grad_norm_",
                   "accelerate.optimizer:AcceleratedOptimizer.step", "accelerate.accelerator:Accelerator.save_state",
                   "accelerate.accelerator:Accelerator.load_state"):
        assert status[target] == "applied", status


def _declared_wrappers():
    """{notes label: the wrapper the engine builds for it} for every patch of the fix set declaring notes."""
    from accel_fp8_fix.engine.declarations import load_patch_sets
    from accel_fp8_fix.engine.engine import Engine

    (fix_set,) = [s for s in load_patch_sets() if s.kind == "fix"]
    engine = Engine(fix_set)
    return {spec.notes: engine.wrapper_for(spec) for spec in fix_set.patches if spec.notes}


def test_declared_notes_hooks_note_the_same_exception_and_never_replace_it():
    """Every patch of patches/*.toml declaring ``notes``, called through the wrapper the engine builds from the
    declaration (the fix plus the set's on_error hook): a known error leaves with a note, unchanged; an
    unknown one leaves untouched; a broken accelerator object does not turn the error into another."""
    original = RuntimeError(MIXED)

    def wrapped(*args, **kwargs):
        raise original

    model = nn.Linear(16, 16)
    accelerator = FakeAccelerator(fp8_backend=None, _models=[model], state=SimpleNamespace(fsdp_plugin=None))
    run_state.record(accelerator).agreed = True  # no patch-set agreement round: no process group here
    wrappers = _declared_wrappers()
    assert set(wrappers) == {"Accelerator.prepare", "Accelerator.backward", "Accelerator.clip_grad_norm_",
                             "Accelerator.save_state", "Accelerator.load_state", "optimizer.step"}
    for where, wrapper in wrappers.items():
        original.__notes__ = []
        setattr(original, notes.NOTED, False)
        with pytest.raises(RuntimeError) as info:
            wrapper(wrapped, accelerator, (model,) if where == "Accelerator.prepare" else (), {})
        assert info.value is original and str(info.value) == MIXED
        assert len(original.__notes__) == 1 and f"({where})" in original.__notes__[0], (where, original.__notes__)
    with pytest.raises(RuntimeError) as info:  # no _models on this object: the error is still the original
        wrappers["Accelerator.backward"](wrapped, object(), (), {})
    assert info.value is original

    def other(*args, **kwargs):
        raise OSError("disk full")

    with pytest.raises(OSError) as info:
        wrappers["Accelerator.save_state"](other, accelerator, (), {})
    assert not hasattr(info.value, "__notes__")


def test_a_failing_on_error_hook_never_replaces_the_error():
    from accel_fp8_fix.engine.declarations import PatchSpec
    from accel_fp8_fix.engine.engine import with_hooks

    def broken_hook(exc, where, instance, args):
        raise KeyError("hook bug")

    def wrapped():
        raise ValueError("user error")

    spec = PatchSpec(target="m:f", notes="f")
    with pytest.raises(ValueError, match="user error"):
        with_hooks(spec, None, on_error=broken_hook)(wrapped, None, (), {})


def test_doctor_launch_names_the_sequence_multiple_a_cp_config_needs_for_its_recipe(tmp_path):
    cp = {"parallelism_config_dp_shard_size": 2, "parallelism_config_cp_size": 2}
    env = {"ACCEL_FP8_FIX_REHEARSAL": "1"}

    def cp_check(**changes):
        verdict = check_launch_config(_config(tmp_path, **changes), environ=env)
        found = [c for c in verdict.checks if c.name == "context parallelism"]
        return verdict, (found[0].detail if found else None)

    verdict, detail = cp_check(parallelism_config=cp)
    assert verdict.ok, str(verdict)
    assert detail.startswith("cp 2: pad every sequence to a multiple of 32 (cp 2 x the delayed recipe's FP8 token "
                             "multiple 16)"), detail
    mxfp8 = {"backend": "TE", "accel_fp8_fix": True, "recipe": "mxfp8"}
    assert "multiple of 64 (cp 2 x the mxfp8 recipe's FP8 token multiple 32)" in cp_check(
        parallelism_config=cp, fp8_config=mxfp8)[1]
    assert "multiple of 4 (cp 2 x 2)" in cp_check(parallelism_config=cp, mixed_precision="bf16")[1]
    assert cp_check()[1] is None  # no CP in the demo's dp_shard x tp config
