#!/usr/bin/env bash
# The distributed suite on the newest torch of the declared window, in a venv of its own (.matrix/, removed
# afterwards: ~7 GB). Measured on the 2-core machine: ~7 min to build the venv, ~10 min for tests/distributed.
# Called from .ci/run after the main suite; ACCEL_FP8_FIX_CI_TORCH picks another release (e.g. the floor, 2.11).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 scripts/version_matrix.py --no-docs --remove-venv "${ACCEL_FP8_FIX_CI_TORCH:-2.14}"
