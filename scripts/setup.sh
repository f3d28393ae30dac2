#!/usr/bin/env bash
# Creates .venv (if missing) with the pinned CPU torch and this package (editable) plus test extras.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
# torch 2.13.0 pinned: a CPU build is available locally; an unpinned torch would pull a multi-GB CUDA build.
python -m pip install --quiet "torch==2.13.0"
python -m pip install --quiet -e ".[test]" "accelerate==1.15.0"
