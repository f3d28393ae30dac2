#!/usr/bin/env bash
# Runs a command on a loaded machine: two busy loops (one per core of the 2-core CI machine) spin beside it, so
# teardown races and collective deadlines show as they do under load. Example:
#   bash scripts/loaded.sh python -m pytest -q tests/distributed/test_fp8_all_gather.py
set -euo pipefail
cd "$(dirname "$0")/.."
busy() { while :; do :; done; }
busy & first=$!
busy & second=$!
trap 'kill "$first" "$second" 2>/dev/null || true' EXIT
"$@"
