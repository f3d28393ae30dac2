"""Choosing a Transformer Engine recipe from accelerate's configuration (fixes/start/recipes.py): by name from
``fp8_config: {recipe: ...}`` / ``ACCELERATE_FP8_RECIPE`` or ``te_recipe_kwargs``, validated against the
installed TE and the GPU generation (here TE's real Python on CPU; the rehearsal answers sm90 or sm100)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from accel_fp8_fix.rehearsal import te_on_cpu

te_on_cpu.install()

import transformer_engine.common.recipe as te_recipe  # noqa: E402
from accelerate.utils import TERecipeKwargs  # noqa: E402

from accel_fp8_fix.fixes.start import recipe_kwargs, recipes  # noqa: E402


@pytest.fixture
def arch():
    """The rehearsal answers sm90 in this process (fixed when it was installed); other GPU generations are
    asked in a subprocess (:func:`_on_arch`)."""
    def check(value):
        assert value == "sm90", "use _on_arch for another generation"
    return check


def _on_arch(arch: str, code: str) -> str:
    """Run ``code`` (after the rehearsal is installed) in a fresh process whose rehearsal reports ``arch``."""
    env = {**os.environ, "ACCEL_FP8_FIX_CPU_TE_ARCH": arch}
    prelude = "from accel_fp8_fix.rehearsal import te_on_cpu; te_on_cpu.install()\n"
    proc = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.parametrize("name,cls", [("delayed", "DelayedScaling"), ("current", "Float8CurrentScaling"),
                                      ("Float8CurrentScaling", "Float8CurrentScaling"), ("delayed_scaling", "DelayedScaling")])
def test_recipe_by_name_from_the_environment(monkeypatch, arch, name, cls):
    arch("sm90")
    monkeypatch.setenv(recipes.ENV, name)
    recipe, _ = recipes.build(None)
    assert type(recipe).__name__ == cls


def test_current_scaling_takes_the_format_and_refuses_delayed_only_settings(monkeypatch, arch):
    arch("sm90")
    recipe, during_eval = recipes.build(recipe_kwargs.te_recipe_kwargs("current", fp8_format="E4M3",
                                                                 use_autocast_during_eval=True))
    assert isinstance(recipe, te_recipe.Float8CurrentScaling) and recipe.fp8_format == te_recipe.Format.E4M3
    assert during_eval is True
    monkeypatch.setenv(recipes.ENV, "current")
    with pytest.raises(ValueError, match=r"amax_history_len set for the 'current' recipe \(Float8CurrentScaling\)"):
        recipes.build(TERecipeKwargs(amax_history_len=16))


def test_unknown_recipe_and_conflicting_settings_are_named(monkeypatch, arch):
    arch("sm90")
    monkeypatch.setenv(recipes.ENV, "fp6")
    with pytest.raises(ValueError, match=r"ACCELERATE_FP8_RECIPE.*'fp6'.*delayed, current, mxfp8, block, nvfp4"):
        recipes.build(None)
    monkeypatch.setenv(recipes.ENV, "current")
    with pytest.raises(ValueError, match="use_mxfp8_block_scaling asks for MXFP8 but .* asks for 'current'"):
        recipes.build(TERecipeKwargs(use_mxfp8_block_scaling=True))


@pytest.mark.parametrize("name,cls,needs", [("mxfp8", "MXFP8BlockScaling", "sm100"), ("nvfp4", "NVFP4BlockScaling", "sm100")])
def test_a_recipe_the_gpu_cannot_run_names_recipe_te_version_and_device(monkeypatch, arch, name, cls, needs):
    arch("sm90")
    with pytest.raises(ValueError) as info:
        recipes.build(recipe_kwargs.te_recipe_kwargs(name))
    message = str(info.value)
    assert cls in message and "Transformer Engine 2." in message and "sm90" in message
    assert "compute capability 10.0 or higher" in message  # TE's own reason
    out = _on_arch(needs, f"""
        from accel_fp8_fix.fixes.start import recipe_kwargs, recipes
        print(type(recipes.build(recipe_kwargs.te_recipe_kwargs({name!r}))[0]).__name__)
        """)
    assert out.split() == [cls]


def test_stock_mxfp8_flag_still_selects_mxfp8_on_blackwell():
    out = _on_arch("sm100", """
        from accelerate.utils import TERecipeKwargs
        from accel_fp8_fix.fixes.start import recipe_kwargs, recipes
        print(type(recipes.build(TERecipeKwargs(use_mxfp8_block_scaling=True))[0]).__name__)
        """)
    assert out.split() == ["MXFP8BlockScaling"]


def test_a_te_recipe_object_is_taken_as_is_after_the_support_check(arch):
    arch("sm90")
    mine = te_recipe.Float8CurrentScaling(fp8_format=te_recipe.Format.HYBRID)
    assert recipes.build(recipe_kwargs.te_recipe_kwargs(mine))[0] is mine


def test_accelerate_launch_exports_the_config_files_recipe_key(tmp_path):
    """``fp8_config: {recipe: current}`` reaches the worker as ACCELERATE_FP8_RECIPE (accelerate's launcher)."""
    config = tmp_path / "config.yaml"
    config.write_text(textwrap.dedent("""\
        compute_environment: LOCAL_MACHINE
        distributed_type: 'NO'
        mixed_precision: fp8
        num_processes: 1
        num_machines: 1
        use_cpu: true
        fp8_config:
          backend: TE
          recipe: current
        """))
    script = tmp_path / "show.py"
    script.write_text("import os; print('RECIPE=' + os.environ.get('ACCELERATE_FP8_RECIPE', '-'))\n")
    env = {**os.environ, "ACCEL_FP8_FIX_REHEARSAL": "1"}
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), str(script)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert "RECIPE=current" in proc.stdout, proc.stderr[-2000:]
