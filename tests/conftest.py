"""Test layers: ``tests/unit`` (one process, no network, seconds), ``tests/distributed`` (several gloo ranks,
the launcher, the demo), ``tests/network`` (installs other releases / builds wheels from the package
registry: skipped without it, failed under ``CI=true``), ``tests/gpu`` (real TE, CUDA only).
The helper modules (``_scenarios`` ...) live here and are importable from every layer."""

import sys
from pathlib import Path

HELPERS = str(Path(__file__).resolve().parent)
if HELPERS not in sys.path:
    sys.path.insert(0, HELPERS)
# Worker processes (run_distributed, accelerate launch) import test modules whose helpers live here.
import os  # noqa: E402

os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (HELPERS, os.environ.get("PYTHONPATH")) if p)
