"""The declared windows against what a fresh install gets today (the registry, asked past the local pip cap).

A release published after a commit is news, not a regression: it skips naming itself (and what to do), it never
turns CI red. What fails: a window or pin that the registry contradicts in a way this commit could have seen —
the CI's newest torch end not the newest minor the window claims, a pin newer than anything released.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("newest_releases", REPO / "scripts" / "newest_releases.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def releases():
    module = _script()
    found = {row["distribution"]: row for row in module.rows()}
    unreachable = [d for d, row in found.items() if not re.fullmatch(r"[0-9.]+", str(row["newest"]))]
    if unreachable:
        pytest.skip(f"package registry unreachable for {unreachable}: {found[unreachable[0]]['newest']}")
    return module, found


def test_every_distribution_has_a_pin_and_the_patched_ones_a_window(releases):
    _, found = releases
    assert set(found) == {"torch", "accelerate", "transformers", "transformer-engine"}
    for dist, row in found.items():
        assert row["pinned"], f"{dist}: no pin in scripts/setup.sh"
        assert Version(row["pinned"]) <= Version(row["newest"]), f"{dist}: pin {row['pinned']} was never released"
    for dist in ("torch", "accelerate", "transformer-engine"):
        assert found[dist]["windows"], f"{dist}: no patch set declares a window"


@pytest.mark.parametrize("dist", ["torch", "accelerate", "transformer-engine"])
def test_the_newest_release_is_inside_every_window(releases, dist):
    row = releases[1][dist]
    outside = [name for name, inside in row["newest_inside"].items() if not inside]
    if outside:
        pytest.skip(f"NEWS: {dist} {row['newest']} is released and outside {outside} "
                    f"({row['windows']}): run scripts/version_matrix.py on it, then widen the window "
                    f"(or try it now with ACCEL_FP8_FIX_PATCH_SET)")


def test_ci_tests_the_newest_torch_minor_the_window_claims(releases):
    _, found = releases
    ci = (REPO / "scripts" / "ci_torch_window.sh").read_text()
    ends = re.findall(r"--\s+(\d+\.\d+)\s+\|\|", ci) + re.findall(r"--remove-venv\s+(\d+\.\d+)\s+\|\|", ci)
    newest_ci = max(ends, key=Version)
    module = _script()
    released = module.registry_versions("torch")
    from accel_fp8_fix.engine import load_patch_sets

    window = next(s for s in load_patch_sets() if s.name == "accelerate-1.13-1.16").requires["torch"]
    claimed = [v for v in released if window.contains(v)]
    newest_minor = f"{claimed[0].major}.{claimed[0].minor}"
    assert newest_ci == newest_minor, (f"scripts/ci_torch_window.sh's newest end is {newest_ci}; the newest torch "
                                       f"the window {window} claims is {claimed[0]}")
