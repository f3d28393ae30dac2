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
    for dist in ("torch", "accelerate", "transformer-engine", "transformers"):
        assert found[dist]["windows"], f"{dist}: no patch set declares a window"


@pytest.mark.parametrize("dist", ["torch", "accelerate", "transformer-engine", "transformers"])
def test_the_newest_release_is_inside_every_window(releases, dist):
    row = releases[1][dist]
    outside = [name for name, inside in row["newest_inside"].items() if not inside]
    if outside:
        pytest.skip(f"NEWS: {dist} {row['newest']} is released and outside {outside} "
                    f"({row['windows']}): run scripts/version_matrix.py on it, then widen the window "
                    f"(or try it now with ACCEL_FP8_FIX_PATCH_SET)")


def test_ci_runs_the_window_low_ends_and_the_registrys_newest(releases):
    """CI's window phase (scripts/ci_torch_window.sh): the oldest torch minor the window claims with the oldest
    transformers the tested window claims, and the canary, which resolves the registry's newest of all four
    distributions when it runs (so it cannot fall behind a release)."""
    from accel_fp8_fix.engine import load_patch_sets

    ci = (REPO / "scripts" / "ci_torch_window.sh").read_text()
    assert re.search(r"version_matrix\.py [^\n]*--newest", ci), "the canary is gone from CI"
    fix_set = next(s for s in load_patch_sets() if s.name == "accelerate-1.13-1.16")
    low = re.search(r"--transformers (\d+\.\d+\.\d+) (\d+\.\d+) ", ci)
    assert low, "CI's low end names no torch / transformers"
    lower = {name: min((Version(one.version) for one in spec if one.operator == ">="), default=None)
             for name, spec in (("torch", fix_set.requires["torch"]), ("transformers", fix_set.tested["transformers"]))}
    assert Version(low.group(2)) == lower["torch"], (low.group(2), lower)
    assert Version(low.group(1)).release[:2] == lower["transformers"].release[:2], (low.group(1), lower)
