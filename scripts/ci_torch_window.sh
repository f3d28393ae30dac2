#!/usr/bin/env bash
# tests/distributed on the newest and the oldest torch of the declared window (2.14, 2.11), each in a venv of its
# own (.matrix/, removed after its run: ~7 GB). Measured on the 2-core machine: ~5-7 min to build a venv, ~21 min for
# tests/distributed, per torch. Called from .ci/run after the main suite (torch 2.13, the project's own venv);
# ACCEL_FP8_FIX_CI_TORCH="2.14" (or any list) picks other releases.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC2086
python3 scripts/version_matrix.py --no-docs --remove-venv ${ACCEL_FP8_FIX_CI_TORCH:-2.14 2.11}
