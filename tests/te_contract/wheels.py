"""Obtain ``transformer-engine`` distributions (pure-Python wheels) for the contract check.

``pip download --no-deps --only-binary=:all: transformer-engine==X -d CACHE``; the cache is
``$ACCEL_FP8_FIX_TE_WHEELS`` or ``~/.cache/accel_fp8_fix/te-wheels``, and a cached wheel is reused
without asking the registry. Nothing is installed or imported: the archive is only read.

Since 1.9 (and through 2.x) TE ships its Python sources as ``transformer_engine-X-py3-none-any.whl``
(the compiled parts live in ``transformer-engine-cu12``/``-torch`` etc.), so a wheel is always what
we want; a non-pure wheel is refused (:class:`RegistryUnavailable`), because it would not be the
source-only distribution this check is written against.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

PIP_TIMEOUT_S = 120
ENV_CACHE = "ACCEL_FP8_FIX_TE_WHEELS"


class RegistryUnavailable(RuntimeError):
    """pip could not provide the distribution (offline, timed out, or no pure wheel)."""


def cache_dir() -> Path:
    env = os.environ.get(ENV_CACHE)
    path = Path(env).expanduser() if env else Path.home() / ".cache" / "accel_fp8_fix" / "te-wheels"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _cached(version: str, cache: Path) -> Optional[Path]:
    for cand in sorted(cache.glob(f"transformer_engine-{version}-*.whl")):
        if cand.name.endswith("-py3-none-any.whl"):
            return cand
    return None


def obtain_wheel(version: str, cache: Optional[Path] = None, timeout: float = PIP_TIMEOUT_S) -> Path:
    """Path of the pure-Python wheel of ``transformer-engine==version`` (downloading it if needed)."""
    cache = cache or cache_dir()
    hit = _cached(version, cache)
    if hit is not None:
        return hit
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", f"transformer-engine=={version}", "-d", str(cache)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RegistryUnavailable(f"`pip download transformer-engine=={version}` timed out after {timeout:.0f} s")
    except OSError as exc:
        raise RegistryUnavailable(f"could not run pip: {exc}")
    hit = _cached(version, cache)
    if proc.returncode != 0 or hit is None:
        lines = [ln for ln in (proc.stderr or proc.stdout).strip().splitlines() if not ln.startswith("WARNING")]
        tail = lines[-2:]
        others = [p.name for p in cache.glob(f"transformer_engine-{version}-*")]
        why = f"no pure-Python wheel among {others}" if others else " | ".join(tail)
        raise RegistryUnavailable(f"`pip download transformer-engine=={version}` failed (rc={proc.returncode}): {why}")
    return hit


def newest_version(major: int, timeout: float = PIP_TIMEOUT_S) -> str:
    """Newest ``major.x`` release on the index (``pip index versions``)."""
    cmd = [sys.executable, "-m", "pip", "index", "versions", "transformer-engine", "--disable-pip-version-check"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RegistryUnavailable(f"`pip index versions transformer-engine` timed out after {timeout:.0f} s")
    match = re.search(r"Available versions:\s*(.+)", proc.stdout)
    if proc.returncode != 0 or not match:
        raise RegistryUnavailable(f"`pip index versions transformer-engine` failed: {proc.stderr.strip()[-300:]}")
    versions: List[str] = [v.strip() for v in match.group(1).split(",")]
    from packaging.version import Version

    picked = [v for v in versions if Version(v).major == major and not Version(v).is_prerelease]
    if not picked:
        raise RegistryUnavailable(f"no transformer-engine {major}.x release listed")
    return str(max(picked, key=Version))
