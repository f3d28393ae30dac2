"""Helpers for tests/network/test_accelerate_versions.py: real accelerate releases of a patch set's window.

* :func:`install` puts ``accelerate==<version>`` (``pip install --no-deps --target``) into a cache directory
  (``$ACCEL_FP8_FIX_TEST_CACHE`` or ``~/.cache/accel_fp8_fix``, ``accelerate-<version>``), which shadows the
  venv's accelerate through ``PYTHONPATH`` (like ``old_accelerate`` in tests/distributed/test_activation.py).
* ``python tests/support/versions.py probe`` (run with ``PYTHONPATH=<that dir>``) prints, as JSON, what the patch
  engine made of that accelerate: the report of the fix set, the rehearsal gates, and every declared target's
  signature next to the one found.
* :func:`launch` runs a plan of this module's scenarios (its own and those it takes from its siblings below) in
  fresh ``run_distributed`` ranks whose accelerate is that release (so one launch can report the accelerate
  version *and* run a scenario).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

# The siblings' scenarios the version tests run (scenarios.run_plan finds a plan's names in this module).
from .fp8_scenarios import sc_checkpoint_load, sc_checkpoint_save, sc_fsdp2_fp8_train  # noqa: F401
from .scenarios import sc_a2_fsdp2_te, sc_a5_ram_efficient  # noqa: F401

HERE = Path(__file__).resolve().parent


def accelerate_at_least(release: str) -> bool:
    """Whether the accelerate this interpreter imports (the venv's, or a shadowing copy on PYTHONPATH) is
    ``release`` or newer: stock behaviours the suite asserts changed with some releases (docs/failures.md)."""
    import accelerate
    from packaging.version import Version

    return Version(accelerate.__version__) >= Version(release)


def cache_root() -> Path:
    return Path(os.environ.get("ACCEL_FP8_FIX_TEST_CACHE", Path.home() / ".cache" / "accel_fp8_fix"))


def install(version: str, timeout: float = 180, package: str = "accelerate") -> tuple[str | None, str]:
    """``(directory, "")`` holding ``package==version`` (installed once, then cached), or ``(None, why)``."""
    module = package.replace("-", "_")
    target = cache_root() / f"{package}-{version}"
    marker = target / f"{module}-{version}.dist-info"
    if (target / module).is_dir() and marker.is_dir():
        return str(target), ""
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--disable-pip-version-check",
             "--target", str(target), f"{package}=={version}"],
            capture_output=True, text=True, timeout=timeout,
        )
    except (subprocess.TimeoutExpired, OSError) as exc:
        return None, f"cannot fetch {package} {version} from the package registry: {exc}"
    if proc.returncode != 0 or not marker.is_dir():
        return None, f"cannot fetch {package} {version} from the package registry: {proc.stderr[-300:]}"
    return str(target), ""


def require(version: str, package: str = "accelerate") -> str:
    """The directory of ``package==version``; without the registry: skip, or fail under CI (``CI=true``),
    where a skipped version test would let a green run hide an untested window."""
    import pytest

    directory, why = install(version, package=package)
    if directory is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(why)
        pytest.skip(why)
    return directory


# -- the static probe (a fresh interpreter with PYTHONPATH=<version dir>) ------------------------------------
def probe() -> dict:
    """Import accelerate with the fix set and the rehearsal gates on; report what applied and the signatures.

    Expects ``ACCEL_FP8_FIX_REHEARSAL=1`` (the bootstrap activates the rehearsal gates) and no ``ACCEL_FP8_FIX=0``.
    """
    import accel_fp8_fix

    import accelerate
    import accelerate.accelerator  # noqa: F401
    import accelerate.utils.fsdp_utils  # noqa: F401

    from accel_fp8_fix.rehearsal import gates as rehearsal
    from accel_fp8_fix.engine import FixWrapper, load_patch_sets
    from accel_fp8_fix.engine.engine import _signature_of, resolve_target

    report = accel_fp8_fix.report()
    signatures = {}
    for patch_set in load_patch_sets():
        for spec in patch_set.patches:
            try:
                _, _, current = resolve_target(spec)
                original = current.__wrapped__ if isinstance(current, FixWrapper) else current
                found = _signature_of(original)
            except Exception as exc:  # noqa: BLE001
                found = f"<{type(exc).__name__}: {exc}>"
            signatures[f"{patch_set.name} {spec.target}"] = {"declared": spec.signature, "found": found,
                                                             "wrapped": isinstance(current, FixWrapper)}
    return {
        "accelerate": accelerate.__version__,
        "accelerate_file": accelerate.__file__,
        "patch_set": report.patch_set,
        "reason": report.reason,
        "error": report.error,
        "patches": {p["target"]: p["status"] for p in report.patches},
        "details": {p["target"]: p["detail"] for p in report.patches if p["detail"]},
        "rehearsal_applied": rehearsal.is_applied(),
        "signatures": signatures,
    }


def run_probe(version_dir: str, timeout: float = 120) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ACCEL_FP8_FIX", "ACCELERATE_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=os.pathsep.join((version_dir, str(HERE.parent))), ACCEL_FP8_FIX_REHEARSAL="1")
    proc = subprocess.run([sys.executable, "-m", "support.versions", "probe"], env=env, capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"probe failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- scenarios inside the ranks ------------------------------------------------------------------------------
def sc_accelerate_version(rank, world_size):
    """Which accelerate this rank really imported, and which layers were on."""
    import accelerate

    from . import scenarios

    return {"version": accelerate.__version__, "file": accelerate.__file__, **scenarios.meta_facts()}


def launch(plan, version_dir: str, env: dict, world_size: int = 2, timeout: float = 300.0):
    """One ``run_distributed`` launch of ``plan`` whose workers import accelerate from ``version_dir`` (fresh
    interpreters: a pool's ranks have the venv's accelerate imported already)."""
    from accel_fp8_fix.testing import run_distributed

    from . import scenarios

    return run_distributed(
        scenarios.suite, world_size, args=(__name__, plan), env={**env, "PYTHONPATH": version_dir}, init_process_group=False,
        timeout=timeout, collective_timeout=60,
    )


if __name__ == "__main__":
    if sys.argv[1:] == ["probe"]:
        print(json.dumps(probe()))
    else:
        sys.exit("usage: python -m support.versions probe")
