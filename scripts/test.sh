#!/usr/bin/env bash
# Sets up, then runs the whole test suite (CPU only; multi-process tests on gloo). Takes the project's one test lock
# (/tmp/accel_fp8_fix.mp.lock, or $ACCEL_FP8_FIX_TEST_LOCK; 0 = none) so that two runners never share the cores:
# do not wrap it in another flock of the same file.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export OMP_NUM_THREADS=1
LOCK=${ACCEL_FP8_FIX_TEST_LOCK:-/tmp/accel_fp8_fix.mp.lock}
if [ "$LOCK" = 0 ]; then
  exec python -m pytest -q "$@"
fi
exec flock "$LOCK" python -m pytest -q "$@"
