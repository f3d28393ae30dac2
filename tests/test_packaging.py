"""The wheel carries the patch-set declarations and the .pth trampoline (they live outside the package
folder in the source tree)."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )
    if proc.returncode != 0:
        if "Could not find a version" in proc.stderr or "Failed to establish" in proc.stderr:
            pytest.skip(f"build backend not reachable: {proc.stderr[-300:]}")
        raise AssertionError(proc.stderr[-3000:])
    return next(out.glob("accel_fp8_fix-*.whl"))


def test_wheel_ships_declarations_and_trampoline(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    declared = {p.name for p in (ROOT / "patches").glob("*.toml")}
    assert declared and {f"accel_fp8_fix/_patches/{n}" for n in declared} <= names
    assert "accel_fp8_fix.pth" in names  # top level of site-packages
    assert "accel_fp8_fix/rehearsal/te_on_cpu/tex.py" in names
    pth = zipfile.ZipFile(wheel).read("accel_fp8_fix.pth").decode()
    assert pth.count("\n") <= 1 and pth.startswith("import os, sys;")  # one stdlib-only line


def test_installed_wheel_finds_its_shipped_declarations(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--target", str(target), str(wheel)],
                   check=True, timeout=300)
    proc = subprocess.run(
        [sys.executable, "-S", "-c",
         "import sys; sys.path.insert(0, sys.argv[1]); "
         "from accel_fp8_fix.engine.declarations import declarations_dir, load_patch_sets; "
         "print(declarations_dir()); print(sorted(s.name for s in load_patch_sets()))", str(target)],
        capture_output=True, text=True, timeout=120,
        env={"PYTHONPATH": ":".join(p for p in sys.path if "site-packages" in p)},
    )
    assert proc.returncode == 0, proc.stderr
    where, names = proc.stdout.splitlines()
    assert where == str(target / "accel_fp8_fix" / "_patches")
    assert "accelerate-1.13-1.15" in names
