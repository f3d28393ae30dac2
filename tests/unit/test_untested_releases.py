"""``ACCEL_FP8_FIX_ALLOW_UNTESTED=1`` (issue 32 item 3): a release newer than every window gets the newest set
whose only misfits are such releases, applied only when every apply-time check passes, said once; never an older
release; without the switch the warning says whether it would apply and what it would check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from accel_fp8_fix import _api

PROBE = Path(__file__).resolve().parents[1] / "support" / "untested_probe.py"
INSTALLED = {"accelerate": "1.15.0", "torch": "2.13.0", "transformer-engine": "2.20.2"}


@pytest.mark.parametrize("versions,allowed,chosen", [
    ({"torch": "2.16.0"}, False, None),
    ({"torch": "2.16.0"}, True, "accelerate-1.13-1.16"),
    ({"accelerate": "1.16.0", "torch": "2.17.1"}, True, "accelerate-1.13-1.16"),
    ({"torch": "2.10.0"}, True, None),  # older than the window: never
    ({"accelerate": "1.12.0", "torch": "2.16.0"}, True, None),  # one older, one newer: never
    ({"torch": "2.16.0.dev20261201"}, True, None),  # a pre-release of the window's bound is not newer than it
])
def test_only_releases_newer_than_the_window_are_tried(monkeypatch, versions, allowed, chosen):
    monkeypatch.setenv("ACCEL_FP8_FIX_ALLOW_UNTESTED", "1" if allowed else "0")
    monkeypatch.delenv("ACCEL_FP8_FIX_PATCH_SET", raising=False)
    selection = _api.choose_patch_set("fix", {**INSTALLED, **versions})
    assert (selection.patch_set.name if selection.patch_set else None) == chosen
    if chosen:
        assert selection.reason.startswith("UNTESTED: newer than its window: ")
        assert f"torch {versions['torch']} (window <2.16,>=2.11)" in selection.reason
        assert "signatures" in selection.reason and "upstream sources by sha256" in selection.reason
    elif versions == {"torch": "2.16.0"}:  # switch off: the warning says what the switch would do
        assert "ACCEL_FP8_FIX_ALLOW_UNTESTED=1 would try accelerate-1.13-1.16" in selection.reason
    else:
        assert "ALLOW_UNTESTED" not in selection.reason


def test_the_switch_takes_strict_values(monkeypatch):
    monkeypatch.setenv("ACCEL_FP8_FIX_ALLOW_UNTESTED", "perhaps")
    with pytest.raises(ValueError, match="ACCEL_FP8_FIX_ALLOW_UNTESTED"):
        _api.choose_patch_set("fix", {**INSTALLED, "torch": "2.16.0"})


def _probe(tmp_path, mode: str, allowed: str) -> dict:
    info = tmp_path / "fake" / "torch-2.16.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.16.0\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_FP8_FIX", "ACCELERATE_"))}
    env.update(PYTHONPATH=os.pathsep.join([str(tmp_path / "fake"), env.get("PYTHONPATH", "")]),
               ACCEL_FP8_FIX_ALLOW_UNTESTED=allowed)
    proc = subprocess.run([sys.executable, str(PROBE), mode], capture_output=True, text=True, env=env, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_newer_torch_over_unchanged_sources_applies_and_says_so_once(tmp_path):
    out = _probe(tmp_path, "same", "1")
    assert out["patch_set"] == "accelerate-1.13-1.16" and out["error"] == "" and out["applied"] > 10
    said = [w for w in out["warnings"] if "untested release" in w]
    assert len(said) == 1 and "torch 2.16.0 (window <2.16,>=2.11)" in said[0]


def test_a_newer_torch_over_a_changed_source_is_refused_naming_it(tmp_path):
    out = _probe(tmp_path, "changed", "1")
    assert out["applied"] == 0
    assert "accelerate.utils.transformer_engine:apply_fp8_autowrap changed upstream" in out["error"]
    assert not [w for w in out["warnings"] if "untested release" in w]


def test_without_the_switch_nothing_is_patched_and_the_warning_says_what_it_would_try(tmp_path):
    out = _probe(tmp_path, "same", "0")
    assert out["patch_set"] is None and out["applied"] == 0
    (said,) = [w for w in out["warnings"] if "nothing patched" in w]
    assert "torch 2.16.0" in said and "ACCEL_FP8_FIX_ALLOW_UNTESTED=1 would try accelerate-1.13-1.16" in said
