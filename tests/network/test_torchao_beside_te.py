"""torchao installed beside Transformer Engine with no FP8 backend chosen (issue 45 item 5): accelerate picks
torchao and this package stands down — said once at ``Accelerator()``, naming ``backend: TE``; the backend is never
changed. The real torchao (the registry's 0.18.0, ``pip install --no-deps --target`` into the test cache, as the
accelerate releases) on ``PYTHONPATH`` of a fresh interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from support import versions

TORCHAO = "0.18.0"
PROBE = """
import json, warnings
from accelerate import Accelerator
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    acc = Accelerator(mixed_precision="fp8")
print(json.dumps({"backend": str(acc.fp8_backend), "said": [str(w.message) for w in caught
                                                            if "accel_fp8_fix" in str(w.message)]}))
"""


@pytest.mark.parametrize("backend", [None, "TE"])
def test_torchao_picked_by_accelerate_is_said_once_naming_backend_te(backend):
    directory = versions.require(TORCHAO, package="torchao")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_FP8_FIX", "ACCELERATE_"))}
    env.update({"ACCEL_FP8_FIX": "1", "ACCEL_FP8_FIX_REHEARSAL": "1", "PYTHONPATH": directory})
    if backend:
        env["ACCELERATE_FP8_BACKEND"] = backend
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if backend is None:  # accelerate's choice stands, and the way to TE is named once
        assert got["backend"].endswith("AO"), got
        (said,) = got["said"]
        assert "accelerate picked torchao, so this package" in said and "fp8_config: {backend: TE}" in said
    else:
        assert got["backend"].endswith("TE") and got["said"] == [], got
