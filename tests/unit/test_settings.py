"""One parser for every setting (accel_fp8_fix/settings.py): the registry is complete, each kind accepts exactly
its documented spellings, ``doctor --launch`` and the run read every setting the same way, recipe settings are
checked where first seen (doctor, ``te_recipe_kwargs``, ``Accelerator()``), malformed YAML is one line, exit 2."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import yaml

from accel_fp8_fix import cli, settings
from accel_fp8_fix.diagnostics.launch_check import check_launch_config
from accel_fp8_fix.fixes.start import handler_choices, recipe_kwargs, recipes

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "accel_fp8_fix"
DEMO = ROOT / "examples/fsdp2_tp_fp8.yaml"
REHEARSAL = {"ACCEL_FP8_FIX_REHEARSAL": "1"}
CLEAN_ENV = {k: v for k, v in os.environ.items()
             if not k.startswith(("ACCEL_FP8_FIX", "ACCELERATE_FP8_", "ACCELERATE_MIXED"))}

# a value each setting accepts (and what it means), and one it refuses (None: every non-empty value is accepted)
GOOD = {"bool": ("Yes", True), "path": ("/tmp/audit", "/tmp/audit"), "seconds": ("2.5", 2.5), "count": (" 12 ", 12)}
BAD = {"bool": "banana", "enum": "banana", "path": None, "seconds": "soon", "count": "0"}


def _good(setting):
    if setting.kind == "enum":
        first = next(iter(setting.choice_map()))
        return first.upper() if not setting.case_sensitive else first, first
    return GOOD[setting.kind]


# -- the registry ---------------------------------------------------------------------------------------------
def _variables_in_source() -> set:
    names = set()
    for path in PACKAGE.rglob("*.py"):
        names |= set(re.findall(r"\b(ACCEL_FP8_FIX_[A-Z0-9_]*[A-Z0-9]|ACCELERATE_FP8_[A-Z0-9_]*[A-Z0-9])\b",
                                path.read_text()))
    return names | {"ACCEL_FP8_FIX"}


def test_every_variable_the_package_reads_is_registered():
    accelerate_own = {"ACCELERATE_FP8_" + s for s, _d in recipes.TE_KWARGS.values() if s} | {
        "ACCELERATE_FP8_OVERRIDE_FPROP", "ACCELERATE_FP8_OVERRIDE_DGRAD", "ACCELERATE_FP8_OVERRIDE_WGRAD",
        "ACCELERATE_FP8_BACKEND"}
    missing = _variables_in_source() - set(settings.REGISTRY) - accelerate_own
    assert not missing, f"read by the package but not in settings.REGISTRY: {sorted(missing)}"


def test_package_code_reads_settings_only_through_the_registry():
    """No direct os.environ / getenv read of a setting outside settings.py (rehearsal/ and testing/ keep their
    own readers, described by the registry and compared below)."""
    allowed = {"settings.py"}
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] in ("rehearsal", "testing") or path.name in allowed:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"(os\.environ(\.get)?|getenv)\s*[\[(]\s*[\"'](ACCEL_FP8_FIX|ACCELERATE_FP8_)", line):
                offenders.append(f"{rel}:{n}: {line.strip()}")
    assert not offenders, offenders


@pytest.mark.parametrize("spelling,meaning", [(v, True) for v in ("1", "true", "TRUE", "Yes", "on", " On ")]
                         + [(v, False) for v in ("0", "false", "False", "no", "NO", "off")]
                         + [(v, None) for v in ("", "  ", None)])
def test_bool_spellings(spelling, meaning):
    assert settings.parse("ACCEL_FP8_FIX", spelling) is meaning


@pytest.mark.parametrize("name", sorted(settings.REGISTRY))
def test_each_setting_accepts_its_spellings_and_names_everything_else(name):
    setting = settings.REGISTRY[name]
    value, meaning = _good(setting)
    assert settings.get(name, {name: value}) == meaning
    assert settings.get(name, {}) is None and settings.get(name, {name: " "}) is None
    assert setting.meaning and setting.accepted() and setting.owner in ("package", "rehearsal", "diagnostics", "testing")
    bad = BAD[setting.kind]
    if bad is None:
        return
    with pytest.raises(ValueError) as info:
        settings.get(name, {name: bad})
    message = str(info.value)
    assert name in message and repr(bad) in message and setting.accepted() in message


def test_recipe_setting_takes_te_class_names_and_the_patch_set_its_declared_names():
    assert settings.parse("ACCELERATE_FP8_RECIPE", "Float8CurrentScaling") == "current"
    assert settings.parse("ACCELERATE_FP8_RECIPE", "delayed-scaling") == "delayed"
    assert settings.parse("ACCEL_FP8_FIX_PATCH_SET", "accelerate-1.13-1.16") == "accelerate-1.13-1.16"
    with pytest.raises(ValueError, match="accelerate-1.13-1.16"):
        settings.parse("ACCEL_FP8_FIX_PATCH_SET", "accelerate-9")


def test_rehearsal_readers_accept_exactly_what_the_registry_lists(monkeypatch):
    from accel_fp8_fix.rehearsal.te_on_cpu import target, tex

    assert set(settings.REGISTRY[target.ENV_TARGET].choice_map()) == set(target.PROFILES)
    assert set(settings.REGISTRY[target.ENV_ARCH].choice_map()) == set(target.ARCHES)
    samples = ["", "sm90", "SM100", "h200-cu130", "B200-CU130", "banana", "1", "0", "on", "true"]
    readers = {target.ENV_TARGET: target.profile, target.ENV_ARCH: target.profile,
               tex.ENV_FAST_ACCUM: tex.fast_accum_enabled}
    for name, reader in readers.items():
        for sample in samples:
            monkeypatch.setenv(name, sample)
            try:
                settings.get(name)
                ours = True
            except ValueError:
                ours = False
            try:
                reader()
                theirs = True
            except ValueError:
                theirs = False
            assert ours == theirs, (name, sample)
        monkeypatch.delenv(name)


# -- doctor --launch and the run agree, setting by setting ---------------------------------------------------
def _write(tmp_path, cfg: dict, name="config.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _demo_cfg() -> dict:
    return yaml.safe_load(DEMO.read_text())


def _doctor_and_run(tmp_path, name, value):
    """(doctor's failed checks mentioning the setting, the run's reading: the value or the ValueError)."""
    setting = settings.REGISTRY[name]
    cfg, environ = _demo_cfg(), dict(REHEARSAL)
    if setting.config_key:
        cfg["fp8_config"][setting.config_key] = value
        run_env = settings.exported_fp8_env(cfg["fp8_config"])  # what accelerate launch gives the worker
    else:
        environ[name] = value
        run_env = environ
    verdict = check_launch_config(_write(tmp_path, cfg), environ=environ)
    failed = [c for c in verdict.checks if not c.ok and c.blocking and name in c.detail]
    try:
        run = settings.get(name, run_env)
    except ValueError as exc:
        run = exc
    return verdict, failed, run


@pytest.mark.parametrize("name", sorted(n for n, s in settings.REGISTRY.items() if BAD[s.kind] is not None))
def test_doctor_and_run_agree_on_a_bad_value(tmp_path, name):  # a path: every non-empty value is accepted
    setting = settings.REGISTRY[name]
    bad = BAD[setting.kind]
    verdict, failed, run = _doctor_and_run(tmp_path, name, bad)
    assert isinstance(run, ValueError) and not verdict.ok and failed, str(verdict)
    assert repr(bad) in failed[0].detail and failed[0].fix, str(verdict)


@pytest.mark.parametrize("name", sorted(settings.REGISTRY))
def test_doctor_and_run_agree_on_a_good_value(tmp_path, name):
    setting = settings.REGISTRY[name]
    value, meaning = _good(setting)
    if name == "ACCEL_FP8_FIX_PATCH_SET":
        value = meaning = "accelerate-1.13-1.16"
    verdict, failed, run = _doctor_and_run(tmp_path, name, value)
    assert run == meaning and not failed, str(verdict)


def test_the_flag_maybe_is_refused_by_both(tmp_path):
    """issue 22 item 1: `accel_fp8_fix: maybe` was 'no flag' to the doctor and 'on' at run time."""
    cfg = _demo_cfg()
    cfg["fp8_config"]["accel_fp8_fix"] = "maybe"
    verdict = check_launch_config(_write(tmp_path, cfg), environ=dict(REHEARSAL))
    assert verdict.failed == ["activation"] and "'maybe'" in str(verdict) and "accel_fp8_fix: true" in str(verdict)
    yes = _demo_cfg()
    yes["fp8_config"]["accel_fp8_fix"] = "yes"  # a string here: YAML's own `yes` is already true
    assert check_launch_config(_write(tmp_path, yes), environ=dict(REHEARSAL)).ok


@pytest.mark.parametrize("value", ["banana", "maybe"])
@pytest.mark.parametrize("variable", ["ACCEL_FP8_FIX", "ACCELERATE_FP8_ACCEL_FP8_FIX"])
def test_a_bad_activation_value_never_activates_and_names_itself(variable, value):
    """Start-up (.pth): one named line on stderr, the fixes stay off; an explicit import raises the same error."""
    code = ("import sys, accelerate\n"
            "m = sys.modules.get('accel_fp8_fix')\n"
            "print('active' if m is not None and m._api.active_patch_set() else 'inactive')\n"
            "try:\n    import accel_fp8_fix\nexcept ValueError as exc:\n    print('import:', exc)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**CLEAN_ENV, variable: value})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "inactive"
    assert lines[1].startswith("import: accel_fp8_fix:") and f"{value!r}" in lines[1] and "1 / true" in lines[1]
    assert f"{value!r}" in proc.stderr and "not activated at start-up" in proc.stderr
    assert "Traceback" not in proc.stderr


# -- recipe settings, where first seen -------------------------------------------------------------------------
RECIPE_CASES = [
    ({"recipe": "current", "fp8_format": "E4M3"}, True),
    ({"recipe": "current", "amax_history_len": 1024}, True),  # accelerate's default: not "set" (to_kwargs)
    ({"recipe": "current", "amax_history_len": 16}, False),
    ({"recipe": "block", "margin": 2}, False),
    ({"recipe": "mxfp8", "margin": 2}, True),
    ({"recipe": "delayed", "amax_history_len": 16, "amax_compute_algo": "max"}, True),
    ({"recipe": "fp6"}, False),
    ({"recipe": "current", "use_mxfp8_block_scaling": True}, False),
    ({"use_mxfp8_block_scaling": True}, True),
    ({"recipe": "nvfp4", "override_linear_precision": [True, False, False]}, False),
    ({"amax_history_len": "many"}, False),
    ({"fp8_format": "E3M4"}, False),
]


@pytest.mark.parametrize("keys,ok", RECIPE_CASES)
def test_doctor_and_accelerator_agree_on_recipe_settings(tmp_path, monkeypatch, keys, ok):
    from accelerate.utils import TERecipeKwargs

    cfg = _demo_cfg()
    cfg["fp8_config"] = {"backend": "TE", "accel_fp8_fix": True, **keys}  # the demo's keys are DelayedScaling's
    verdict = check_launch_config(_write(tmp_path, cfg), environ=dict(REHEARSAL))
    (check,) = [c for c in verdict.checks if c.name == "FP8 recipe"]
    assert check.ok is ok, str(verdict)
    if not ok:
        assert check.fix and "FP8 recipe" in verdict.failed, str(verdict)
    # the run: the worker's environment (what accelerate launch exports), TERecipeKwargs() as Accelerator() builds
    # it, then the check Accelerator() and prepare run
    for name in [k for k in os.environ if k.startswith("ACCELERATE_FP8_")]:
        monkeypatch.delenv(name)
    for name, value in settings.exported_fp8_env(cfg["fp8_config"]).items():
        monkeypatch.setenv(name, value)
    try:
        recipes.check_handler(TERecipeKwargs())
        run_ok = True
    except ValueError:
        run_ok = False
    assert run_ok is ok


def test_doctor_names_the_line_to_change_for_a_recipe_setting(tmp_path):
    cfg = _demo_cfg()  # its fp8_config: fp8_format HYBRID, amax_history_len 16, amax_compute_algo max
    cfg["fp8_config"].update(recipe="current")
    text = str(check_launch_config(_write(tmp_path, cfg), environ=dict(REHEARSAL)))
    assert "WILL NOT run" in text and "[FAIL] FP8 recipe: amax_compute_algo, amax_history_len set for the 'current' recipe" in text
    assert "remove `amax_history_len: 16` from fp8_config" in text and "remove `amax_compute_algo: max`" in text
    cfg["fp8_config"].update(recipe="fp6")
    text = str(check_launch_config(_write(tmp_path, cfg), environ=dict(REHEARSAL)))
    assert "[FAIL] FP8 recipe: fp8_config.recipe (ACCELERATE_FP8_RECIPE)='fp6'" in text
    assert "recipe: delayed  (one of delayed, current, mxfp8, block, nvfp4)" in text


def test_te_recipe_kwargs_refuses_unknown_fields_and_settings_the_recipe_does_not_take():
    from accel_fp8_fix.rehearsal import te_on_cpu

    te_on_cpu.install()  # TE's recipe classes (their fields) on CPU
    with pytest.raises(TypeError, match=r"unknown field 'bogus_field' for the current recipe"):
        recipe_kwargs.te_recipe_kwargs(recipe="current", bogus_field=3)
    with pytest.raises(TypeError, match=r"unknown fields 'a', 'b'"):
        recipe_kwargs.te_recipe_kwargs(recipe="delayed", b=1, a=2)
    with pytest.raises(ValueError, match=r"amax_history_len set for the 'current' recipe"):
        recipe_kwargs.te_recipe_kwargs(recipe="current", amax_history_len=16)
    import transformer_engine.common.recipe as te_recipe

    with pytest.raises(TypeError, match="unknown field 'fp4_format'"):
        recipe_kwargs.te_recipe_kwargs(te_recipe.Float8CurrentScaling(), fp4_format="E2M1")
    handler = recipe_kwargs.te_recipe_kwargs(recipe="current", fp8_format="E4M3", use_power_2_scales=True)  # TE's own
    choice = handler_choices.choice_of(handler)
    assert (choice.recipe, choice.extra) == ("current", {"use_power_2_scales": True})


ACCELERATOR_SCRIPT = """
import json, os, sys
import accel_fp8_fix
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState, PartialState
for case in json.loads(sys.argv[1]):  # one Accelerator() per case, accelerate's singletons reset between them
    saved = {name: os.environ.get(name) for name in case}
    os.environ.update(case)
    try:
        accelerator = Accelerator(mixed_precision="fp8")
    except ValueError as exc:
        print(json.dumps(f"refused: {exc}"))
    else:
        print(json.dumps(f"ok {accelerator.fp8_enabled} {accel_fp8_fix.active_patch_set()}"))
    for name, value in saved.items():
        os.environ.pop(name) if value is None else os.environ.__setitem__(name, value)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()
"""
ACCELERATOR_CASES = [
    ({"ACCELERATE_FP8_RECIPE": "current"}, "ok True accelerate-1.13-1.16"),
    ({"ACCELERATE_FP8_RECIPE": "current", "ACCELERATE_FP8_AMAX_HISTORY_LEN": "16"},
     "refused: accel_fp8_fix: amax_history_len set for the 'current' recipe"),
    ({"ACCELERATE_FP8_RECIPE": "fp6"}, "refused: accel_fp8_fix: fp8_config.recipe (ACCELERATE_FP8_RECIPE)='fp6'"),
    ({"ACCEL_FP8_FIX_LOG_RANKS": "some"}, "refused: accel_fp8_fix: ACCEL_FP8_FIX_LOG_RANKS='some'"),
    ({"ACCELERATE_FP8_RECIPE": "current"}, "ok True accelerate-1.13-1.16"),  # nothing a refusal left behind
]


@pytest.fixture(scope="module")
def accelerator_answers():
    """Every case of ACCELERATOR_CASES in one process (the rehearsal's TE): its answer per case, in order."""
    proc = subprocess.run([sys.executable, "-c", ACCELERATOR_SCRIPT, json.dumps([env for env, _ in ACCELERATOR_CASES])],
                          capture_output=True, text=True, timeout=180, env={**CLEAN_ENV, **REHEARSAL})
    assert proc.returncode == 0, proc.stderr[-3000:]
    answers = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('"')]
    assert len(answers) == len(ACCELERATOR_CASES), proc.stdout + proc.stderr[-2000:]
    return answers


@pytest.mark.parametrize("case", range(len(ACCELERATOR_CASES)))
def test_accelerator_checks_the_settings_before_any_model(accelerator_answers, case):
    """One process, the rehearsal's TE; the check runs inside Accelerator() (patch `settings`)."""
    env, expect = ACCELERATOR_CASES[case]
    assert accelerator_answers[case].startswith(expect), (env, accelerator_answers[case])


# -- malformed YAML ----------------------------------------------------------------------------------------------
def test_malformed_yaml_is_one_line_with_file_line_column_and_exit_2(tmp_path, capsys):
    path = tmp_path / "broken.yaml"
    path.write_text("mixed_precision: fp8\nfp8_config:\n  backend: TE\n accel_fp8_fix: [true\n")
    assert cli.main(["doctor", "--launch", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1, err
    assert re.match(rf"accel_fp8_fix doctor --launch: {re.escape(str(path))}:4:2: not valid YAML: ", err), err
    assert "Traceback" not in err
    path.write_text("{mixed_precision: fp8\n")  # an unclosed flow mapping: the parser's mark is at the end
    assert cli.main(["doctor", "--launch", str(path)]) == 2
    err = capsys.readouterr().err
    assert re.match(rf"accel_fp8_fix doctor --launch: {re.escape(str(path))}:\d+:\d+: not valid YAML: ", err), err
    assert cli.main(["doctor", "--launch", str(tmp_path / "missing.yaml")]) == 2  # unreadable: 2 as well


def test_plain_doctor_lists_invalid_settings(monkeypatch, capsys):
    monkeypatch.setenv("ACCEL_FP8_FIX_AUDIT", "sometimes")
    assert cli.doctor() == 1
    assert "INVALID     : accel_fp8_fix: ACCEL_FP8_FIX_AUDIT='sometimes'" in capsys.readouterr().out


def test_the_troubleshooting_table_lists_every_setting():
    text = (ROOT / "docs/troubleshooting.md").read_text()
    table = text[text.index("## Settings"):]
    for setting in settings.REGISTRY.values():
        assert f"`{setting.name}`" in table, setting.name
        if setting.config_key:
            assert f"`fp8_config: {{{setting.config_key}: ...}}`" in table, setting.config_key


def test_doctor_launch_with_recipe_settings_imports_neither_torch_nor_accelerate(tmp_path):
    cfg = _demo_cfg()
    cfg["fp8_config"].update(recipe="current")
    code = ("import sys\nfrom accel_fp8_fix.diagnostics.launch_check import check_launch_config\n"
            f"verdict = check_launch_config({_write(tmp_path, cfg)!r}, environ={REHEARSAL!r})\n"
            "print(verdict.failed, [m for m in ('torch', 'accelerate', 'transformer_engine') if m in sys.modules])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=CLEAN_ENV)  # (the rehearsal's start-up hook would import torch itself)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['FP8 recipe'] []", proc.stdout


def test_the_old_rehearsal_name_still_works_with_one_warning(monkeypatch):
    monkeypatch.setattr(settings, "_warned", set())
    monkeypatch.delenv("RANK", raising=False)
    old = {"ACCEL_FP8_FIX_EMULATE_TE": "1"}
    with pytest.warns(FutureWarning, match="ACCEL_FP8_FIX_EMULATE_TE is deprecated; set ACCEL_FP8_FIX_REHEARSAL"):
        assert settings.get(settings.REHEARSAL, old) is True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert settings.get(settings.REHEARSAL, old) is True  # once per process
        assert settings.get(settings.REHEARSAL, {**old, settings.REHEARSAL: "0"}) is False  # the new name wins
        assert settings.get(settings.REHEARSAL, {}) is None
    with pytest.raises(ValueError, match="ACCEL_FP8_FIX_EMULATE_TE='banana'"):
        settings.get(settings.REHEARSAL, {"ACCEL_FP8_FIX_EMULATE_TE": "banana"})


def test_the_old_rehearsal_name_starts_the_rehearsal_at_start_up():
    out = subprocess.run([sys.executable, "-c", "import accel_fp8_fix.rehearsal as r; "
                          "print('installed' if r.is_installed() else 'not installed')"],
                         capture_output=True, text=True, timeout=120,
                         env={**CLEAN_ENV, "ACCEL_FP8_FIX_EMULATE_TE": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1:] == ["installed"] and out.stderr.count("is deprecated") == 1, (out.stdout, out.stderr)
