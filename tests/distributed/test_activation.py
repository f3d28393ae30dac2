"""The ways in, each in a fresh interpreter: import orderings, ACCEL_FP8_FIX, the .pth trampoline,
the accelerate config flag under a real `accelerate launch`, torchrun, strict mode, unsupported versions."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent.parent / "support"  # the probe script
CLEAN_ENV = {
    k: v
    for k, v in os.environ.items()
    if not k.startswith(("ACCEL_FP8_FIX", "ACCELERATE_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")
}


def run_py(code, env=None, check=True, timeout=120):
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**CLEAN_ENV, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


PREPARE_KIND = "type(accelerate.accelerator.Accelerator.__dict__['prepare']).__name__"


def test_import_package_never_imports_torch_or_accelerate():
    out = run_py(
        """
        import sys, accel_fp8_fix
        print(sorted(m for m in ('torch', 'accelerate', 'transformers', 'packaging.specifiers') if m in sys.modules))
        print(accel_fp8_fix.report().reason)
        """
    )
    assert out.stdout.splitlines() == ["[]", "pending: the patch set is chosen when accelerate is imported"]


@pytest.mark.parametrize(
    "code",
    [
        "import accel_fp8_fix, accelerate.accelerator",  # package first: applied on import of accelerate
        "import accelerate.accelerator, accel_fp8_fix",  # accelerate first: applied at once
        "import accelerate.accelerator, accel_fp8_fix; accel_fp8_fix.activate(); accel_fp8_fix.activate()",
    ],
    ids=["package-then-accelerate", "accelerate-then-package", "activate-twice"],
)
def test_import_orderings_apply_exactly_once(code):
    out = run_py(
        f"""
        {code}
        from accel_fp8_fix.engine import FixWrapper
        prepare = accelerate.accelerator.Accelerator.__dict__['prepare']
        print({PREPARE_KIND}, isinstance(prepare.__wrapped__, FixWrapper), accel_fp8_fix.report().applied)
        """
    )
    assert out.stdout.split() == ["FixWrapper", "False", "True"]


def test_deactivate_restores_the_original_and_reactivate_patches_again():
    out = run_py(
        f"""
        import accelerate.accelerator
        original = accelerate.accelerator.Accelerator.__dict__['prepare']
        import accel_fp8_fix
        print({PREPARE_KIND})
        accel_fp8_fix.deactivate()
        print(accelerate.accelerator.Accelerator.__dict__['prepare'] is original)
        accel_fp8_fix.activate()
        print({PREPARE_KIND}, accel_fp8_fix.report().patches[0]['status'])
        """
    )
    assert out.stdout.split() == ["FixWrapper", "True", "FixWrapper", "applied"]


def test_env_zero_disables_even_an_explicit_import_and_activate():
    out = run_py(
        f"""
        import accel_fp8_fix, accelerate.accelerator
        accel_fp8_fix.activate()
        print({PREPARE_KIND}, '|', accel_fp8_fix.report().mode)
        """,
        env={"ACCEL_FP8_FIX": "0"},
    )
    assert out.stdout.strip() == "function | disabled by ACCEL_FP8_FIX=0"


def test_env_one_activates_through_the_pth_trampoline_without_any_import():
    out = run_py(
        f"""
        import sys
        print('accel_fp8_fix' in sys.modules)
        import accelerate.accelerator
        print({PREPARE_KIND})
        """,
        env={"ACCEL_FP8_FIX": "1"},
    )
    assert out.stdout.split() == ["True", "FixWrapper"]


def test_trampoline_costs_nothing_when_unset():
    out = run_py("import sys; print('accel_fp8_fix' in sys.modules)")
    assert out.stdout.strip() == "False"


def test_trampoline_never_breaks_interpreter_start_up(tmp_path):
    """A half-installed package (its import raises) must not stop Python from starting."""
    broken = tmp_path / "accel_fp8_fix"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise ImportError('half installed')\n")
    proc = subprocess.run(
        [sys.executable, "-c", "print('started')"],
        env={**CLEAN_ENV, "ACCEL_FP8_FIX": "1", "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "started"
    assert "accel_fp8_fix: not activated at start-up: the package failed to import (ImportError: half installed)" in proc.stderr


def test_strict_env_turns_a_failed_selection_into_an_error():
    # The set is chosen when accelerate is imported: that import is what raises.
    proc = run_py(
        "import accel_fp8_fix; print('package imported'); import accelerate",
        env={"ACCEL_FP8_FIX_STRICT": "1", "ACCEL_FP8_FIX_PATCH_SET": "no-such-set"},
        check=False,
    )
    assert proc.stdout.strip() == "package imported"
    assert proc.returncode != 0
    assert "UnsupportedVersionError" in proc.stderr and "no-such-set" in proc.stderr


def test_doctor_reports_versions_set_and_mode():
    proc = subprocess.run(
        [sys.executable, "-m", "accel_fp8_fix", "doctor", "--json"],
        env={**CLEAN_ENV, "ACCEL_FP8_FIX": "1"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["patch_set"] == "accelerate-1.13-1.16"
    assert info["versions"]["accelerate"].startswith("1.1")
    assert info["activation"]["this process"] == "environment (ACCEL_FP8_FIX=1)"
    assert info["activation"]["start-up trampoline (.pth) installed"] is True
    assert any(p["target"] == "accelerate.accelerator:Accelerator.prepare" for p in info["will_patch"])


# -- a real older accelerate, outside every window -----------------------------------------------------
@pytest.fixture(scope="module")
def old_accelerate(tmp_path_factory):
    """accelerate 1.5.0 installed into a throwaway directory that shadows the venv's accelerate."""
    cache = Path(os.environ.get("ACCEL_FP8_FIX_TEST_CACHE", Path.home() / ".cache" / "accel_fp8_fix")) / "accelerate-1.5.0"
    if not (cache / "accelerate").is_dir():
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--target", str(cache), "accelerate==1.5.0"],
            capture_output=True,
            text=True,
            timeout=180,
        )
        if proc.returncode != 0:
            pytest.skip(f"cannot fetch accelerate 1.5.0 from the package registry: {proc.stderr[-300:]}")
    return str(cache)


def test_unsupported_real_accelerate_warns_and_leaves_it_untouched(old_accelerate):
    out = run_py(
        f"""
        import warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            import accel_fp8_fix
            import accelerate, accelerate.accelerator
        print(accelerate.__version__, {PREPARE_KIND})
        print(' || '.join(str(w.message) for w in caught))
        """,
        env={"PYTHONPATH": old_accelerate},
    )
    first, warned = out.stdout.splitlines()
    assert first.split() == ["1.5.0", "function"]
    assert "unsupported versions" in warned and "accelerate 1.5.0" in warned
    assert "accelerate-1.13-1.16: [accelerate <1.17,>=1.13" in warned  # names the supported windows


def test_unsupported_real_accelerate_raises_in_strict_mode(old_accelerate):
    proc = run_py(
        "import accel_fp8_fix; accel_fp8_fix.activate(strict=True)",
        env={"PYTHONPATH": old_accelerate, "ACCEL_FP8_FIX": "0"},
        check=False,
    )
    assert proc.returncode == 0  # ACCEL_FP8_FIX=0 wins over everything
    proc = run_py("import accel_fp8_fix, accelerate", env={"PYTHONPATH": old_accelerate, "ACCEL_FP8_FIX_STRICT": "1"},
                  check=False)
    assert proc.returncode != 0
    assert "UnsupportedVersionError: accel_fp8_fix: nothing patched: unsupported versions" in proc.stderr
    assert "accelerate 1.5.0" in proc.stderr


# -- no change to the training script: accelerate launch + config flag, torchrun + env ------------------
def _read_ranks(out_dir, n):
    files = sorted(Path(out_dir).glob("rank*.json"))
    assert len(files) == n, f"expected {n} worker reports, got {[f.name for f in files]}"
    return [json.loads(f.read_text()) for f in files]


def _fp8_launch_config(tmp_path, flag: bool):
    """An accelerate config for 2 CPU workers with TE FP8, with or without the package's flag."""
    config = tmp_path / "config.yaml"
    config.write_text(textwrap.dedent("""
        compute_environment: LOCAL_MACHINE
        distributed_type: MULTI_GPU
        use_cpu: true
        num_machines: 1
        num_processes: 2
        machine_rank: 0
        main_training_function: main
        mixed_precision: fp8
        fp8_config:
          backend: TE
        """) + ("  accel_fp8_fix: true\n" if flag else ""))
    return config


def test_accelerate_config_flag_activates_every_worker_of_accelerate_launch(tmp_path):
    config = _fp8_launch_config(tmp_path, flag=True)
    # The launcher itself checks that an FP8 library exists (the installed transformer-engine
    # distribution); the workers get nothing but what the launcher exports from the config file.
    launcher = "import sys; from accelerate.commands.accelerate_cli import main; sys.argv = ['accelerate'] + sys.argv[1:]; main()"
    env = {**CLEAN_ENV, "ACCEL_FP8_FIX": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", launcher, "launch", "--config_file", str(config), "--main_process_port", "0",
         str(HERE / "activation_probe.py"), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for worker in _read_ranks(tmp_path, 2):
        assert worker["flag_env"] == "True"
        assert worker["prepare_type"] == "FixWrapper" and worker["imported_by_startup"]
        assert worker["mode"].startswith("accelerate config")
        assert worker["patch_set"] == "accelerate-1.13-1.16"


def test_env_var_activates_every_worker_of_torchrun(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "0",
         str(HERE / "activation_probe.py"), str(tmp_path)],
        env={**CLEAN_ENV, "ACCEL_FP8_FIX": "1", "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for worker in _read_ranks(tmp_path, 2):
        assert worker["prepare_type"] == "FixWrapper" and worker["imported_by_startup"]
        assert worker["mode"] == "environment (ACCEL_FP8_FIX=1)"


def test_deactivate_before_accelerate_is_imported_means_nothing_is_patched():
    out = run_py(
        f"""
        import accel_fp8_fix
        accel_fp8_fix.deactivate()
        import accelerate.accelerator
        print({PREPARE_KIND}, accel_fp8_fix.report().applied)
        accel_fp8_fix.activate()
        print({PREPARE_KIND}, accel_fp8_fix.report().applied)
        """
    )
    assert out.stdout.split() == ["function", "False", "FixWrapper", "True"]


def test_rehearsal_flag_alone_changes_where_te_comes_from_and_nothing_else(tmp_path):
    """ACCEL_FP8_FIX_REHEARSAL=1 + accelerate launch with a config *without* the flag: no worker's accelerate
    is patched at start-up (the rehearsal is installed), and the script's own `import accel_fp8_fix` is
    still a way in, exactly as on a GPU."""
    config = _fp8_launch_config(tmp_path, flag=False)
    env = {**CLEAN_ENV, "ACCEL_FP8_FIX_REHEARSAL": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file", str(config),
         "--main_process_port", "0", str(HERE / "activation_probe.py"), str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for worker in _read_ranks(tmp_path, 2):
        assert worker["flag_env"] is None
        assert worker["prepare_type"] == "function" and not worker["imported_by_startup"]  # not patched
        assert worker["te_kernels"] == "accel_fp8_fix.rehearsal.te_on_cpu.tex"  # the rehearsal is on
        assert worker["mode"] == "import accel_fp8_fix" and worker["prepare_type_after_import"] == "FixWrapper"
