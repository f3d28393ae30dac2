"""The emulation's import finder / distribution metadata (each case in a fresh interpreter)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str, env=None, extra_path=None) -> subprocess.CompletedProcess:
    environ = dict(os.environ)
    environ.pop("ACCEL_FP8_FIX_EMULATE_TE", None)
    environ.update(env or {})
    paths = ([str(extra_path)] if extra_path else []) + [str(ROOT)]
    environ["PYTHONPATH"] = os.pathsep.join(paths + [environ.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", textwrap.dedent(code)],
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc


def _ok(proc):
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_install_does_not_import_torch_and_aliases_are_one_module():
    out = _ok(
        _run(
            """
            import sys
            import accel_fp8_fix.emulation as emu
            torch_before = "torch" in sys.modules
            emu.install()
            import transformer_engine, transformer_engine.common.recipe as recipe
            assert "torch" not in sys.modules or torch_before, "install()/recipe imported torch"
            print("TORCH_AFTER_INSTALL", "torch" in sys.modules, torch_before)
            assert transformer_engine.__emulated__ is True
            import transformer_engine.pytorch as te
            assert "torch" in sys.modules
            import accel_fp8_fix.emulation.te.pytorch as emu_te
            assert te is emu_te and te.Linear is emu_te.Linear and te.__emulated__
            assert recipe.DelayedScaling is sys.modules["accel_fp8_fix.emulation.te.common.recipe"].DelayedScaling
            import transformer_engine.pytorch.fp8 as fp8, transformer_engine.pytorch.quantization as q
            assert fp8.check_mxfp8_support()[0] is False and "emulation on CPU" in fp8.check_mxfp8_support()[1]
            assert q.autocast is te.autocast
            from transformer_engine.pytorch.module.linear import Linear
            assert Linear is te.Linear
            import importlib.metadata as md
            assert md.version("transformer-engine") == emu.DIST_VERSION == "2.20.2+emulated"
            assert md.metadata("transformer_engine")["Name"] == "transformer-engine"
            emu.uninstall()
            assert not any(k == "transformer_engine" or k.startswith("transformer_engine.") for k in sys.modules)
            try:
                import transformer_engine
            except ImportError:
                print("GONE")
            """
        )
    )
    assert "GONE" in out
    assert "TORCH_AFTER_INSTALL False False" in out


def test_accelerate_sees_transformer_engine_only_while_installed():
    out = _ok(
        _run(
            """
            import accel_fp8_fix.emulation as emu
            from accelerate.utils import imports as I
            from accelerate.utils import is_transformer_engine_available, is_fp8_available
            others = I.is_msamp_available() or I.is_torchao_available()
            assert not is_transformer_engine_available()
            emu.install()
            assert is_transformer_engine_available() and is_fp8_available()
            assert I.is_transformer_engine_mxfp8_available() is False
            emu.uninstall()
            assert not is_transformer_engine_available()
            assert is_fp8_available() == others
            print("OK")
            """
        )
    )
    assert "OK" in out


@pytest.fixture
def fake_te(tmp_path):
    pkg = tmp_path / "transformer_engine"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("REAL = True\n")
    return tmp_path


def test_refuses_to_shadow_a_real_te(fake_te):
    out = _ok(
        _run(
            """
            import accel_fp8_fix.emulation as emu
            try:
                emu.install()
            except RuntimeError as e:
                msg = str(e)
                assert "force=True" in msg and "ACCEL_FP8_FIX_EMULATE_TE=force" in msg, msg
                assert "transformer_engine" in msg and "__init__.py" in msg, msg
                print("REFUSED")
            assert not emu.is_installed()
            import transformer_engine
            assert transformer_engine.REAL
            """,
            extra_path=fake_te,
        )
    )
    assert "REFUSED" in out


@pytest.mark.parametrize("how", ["arg", "env"])
def test_force_shadows_a_real_te(fake_te, how):
    call = "emu.install(force=True)" if how == "arg" else "emu.install()"
    env = {"ACCEL_FP8_FIX_EMULATE_TE": "force"} if how == "env" else {}
    _ok(
        _run(
            f"""
            import accel_fp8_fix.emulation as emu
            {call}
            import transformer_engine
            assert transformer_engine.__emulated__ and not hasattr(transformer_engine, "REAL")
            """,
            env=env,
            extra_path=fake_te,
        )
    )


def test_accelerate_convert_model_and_fp8_autowrap_run_on_the_emulation():
    out = _ok(
        _run(
            """
            import accel_fp8_fix.emulation as emu
            emu.install()
            import torch
            from accelerate import Accelerator
            Accelerator(cpu=True)
            from accelerate.utils import FP8RecipeKwargs
            from accelerate.utils.transformer_engine import apply_fp8_autowrap, convert_model, has_transformer_engine_layers
            import transformer_engine.pytorch as te
            m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 16))
            with torch.no_grad():
                convert_model(m)
            assert isinstance(m[0], te.Linear) and isinstance(m[1], te.LayerNorm) and has_transformer_engine_layers(m)
            apply_fp8_autowrap(m, FP8RecipeKwargs(backend="TE", fp8_format="HYBRID", amax_history_len=16))
            m(torch.randn(8, 32)).sum().backward()
            assert emu.stats()["fp8_gemms"] == 5 and m[0].fp8_meta["recipe"].amax_history_len == 16
            print("OK")
            """
        )
    )
    assert "OK" in out
