#!/usr/bin/env bash
# Sets up, then runs the whole test suite (CPU only; multi-process tests on gloo).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export OMP_NUM_THREADS=1
python -m pytest -q "$@"
