#!/usr/bin/env bash
# The ends of the declared torch window, each in a venv of its own (.matrix/, removed after its run: ~7 GB), after
# the main suite (torch 2.13, the project's own venv). Called from .ci/run.
#   - the oldest (2.11): all of tests/distributed;
#   - the newest (2.15, installed from the registry past a machine's local pip cap; a CUDA build, ~5.7 GB, run on
#     CPU): the files that reach torch's private internals (FSDP2's all-gather extension and
#     parameter records, _StridedShard, DCP's per-tensor hooks, DTensor TP; the audit's reading of c10d's flight
#     recorder), which a new torch moves first.
# The whole window (every file, every minor) runs with `python scripts/version_matrix.py 2.11 2.12 2.13 2.14 2.15` at each stop
# (docs/compatibility.md). Measured on the 2-core machine (2026-12-02): ~1 min to build a venv with a warm pip
# cache; 2.11 ~13 min, 2.15's seven files ~3 min (figures per CI run: docs/compatibility.md "CI").
# ACCEL_FP8_FIX_CI_TORCH="2.15" (or any list) runs all of tests/distributed on those releases instead.
# The oldest runs its rank pools with every rank started anew (ACCEL_FP8_FIX_TEST_POOL_FORK=0; the README's command
# forks them from one start-up interpreter): that path stays exercised, and with it ranks whose string hashes differ
# (forked ranks share the start-up interpreter's hash seed, so an iteration over a set of strings runs in the same
# order on every rank; started ones, as under torchrun, may differ).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${ACCEL_FP8_FIX_CI_TORCH:-}" ]; then
  # shellcheck disable=SC2086
  exec python3 scripts/version_matrix.py --no-docs --remove-venv $ACCEL_FP8_FIX_CI_TORCH
fi
status=0
ACCEL_FP8_FIX_TEST_POOL_FORK=0 python3 scripts/version_matrix.py --no-docs --remove-venv 2.11 || status=1
python3 scripts/version_matrix.py --no-docs --remove-venv --tests \
  tests/distributed/test_fsdp2_fp8.py tests/distributed/test_tp_fp8.py tests/distributed/test_fp8_all_gather.py \
  tests/distributed/test_tp_packed_checkpoint.py tests/distributed/test_moe_fp8.py \
  tests/distributed/test_load_full_state_dict.py tests/distributed/test_collective_order.py -- 2.15 || status=1
exit $status
