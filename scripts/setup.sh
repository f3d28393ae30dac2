#!/usr/bin/env bash
# Creates .venv (if missing) with the pinned CPU torch and this package (editable) plus test extras.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
say() { echo "setup: $*" >&2; }
if [ ! -x .venv/bin/python ]; then
  say "creating .venv with $("$PY" --version 2>&1) (first run: about 1-2 minutes of downloads and installs)"
  "$PY" -m venv .venv
fi
. .venv/bin/activate
say "checking .venv: pip, torch 2.13.0 (CPU), accelerate 1.16.0, transformers 5.25.0, Transformer Engine 2.20.2's"
say "  Python with this package and its CPU rehearsal (editable) — quick when already installed"
python -m pip install --quiet --upgrade pip
# torch 2.13.0 pinned: a CPU build is available locally; an unpinned torch would pull a multi-GB CUDA build.
python -m pip install --quiet "torch==2.13.0"
# The pins the suite is written against: accelerate 1.16, transformers 5.25, Transformer Engine 2.20.2's
# Python (CPU rehearsal; its kernels come from accel_fp8_fix.rehearsal) with triton 3.9.
python -m pip install --quiet -e ".[test,rehearsal-dev]" "accelerate==1.16.0" "transformers==5.25.0" \
    "transformer-engine==2.20.2" "triton==3.9.0"
python - <<'PY' >&2
import accelerate, torch, transformers
print(f"setup: ready: .venv with torch {torch.__version__}, accelerate {accelerate.__version__}, "
      f"transformers {transformers.__version__}")
PY
