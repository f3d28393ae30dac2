#!/usr/bin/env bash
# The ends of the declared windows, each in a venv of its own (.matrix/, removed after its run: ~7 GB), after the
# main suite (torch 2.13 and the suite's pins, the project's own venv). Called from .ci/run.
#   - the low end: torch 2.11 with transformers 5.24.0 (the oldest of each window): all of tests/distributed;
#   - the canary: the registry's newest torch, accelerate, transformers and Transformer Engine, resolved when it runs
#     (torch installed past a machine's local pip cap; a CUDA build, ~5.7 GB, run on CPU). tests/network/test_canary.py
#     first (the news and the package's verified behaviour on them), then — when every one is inside its declared
#     window, else they are news and the canary's checks are the run — the files that reach private internals
#     (FSDP2's all-gather extension and parameter records, _StridedShard, DCP's per-tensor hooks, DTensor TP,
#     transformers' TP styles and experts; the audit's reading of c10d's flight recorder), which a new release moves
#     first. A newest release inside a window that fails them turns CI red.
# The whole window (every file, every minor) runs with `python scripts/version_matrix.py 2.11 2.12 2.13 2.14 2.15` at
# each stop (docs/compatibility.md). Measured on the 2-core machine: ~1 min to build a venv with a warm pip cache;
# 2.11 ~13 min, the canary's files ~3 min (figures per CI run: docs/compatibility.md "CI").
# ACCEL_FP8_FIX_CI_TORCH="2.15" (or any list) runs all of tests/distributed on those releases instead.
# The low end runs its rank pools with every rank started anew (ACCEL_FP8_FIX_TEST_POOL_FORK=0; the README's command
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
ACCEL_FP8_FIX_TEST_POOL_FORK=0 python3 scripts/version_matrix.py --no-docs --remove-venv --transformers 5.24.0 2.11 \
  || status=1
python3 scripts/version_matrix.py --no-docs --remove-venv --newest --tests \
  tests/distributed/test_fsdp2_fp8.py tests/distributed/test_tp_fp8.py tests/distributed/test_fp8_all_gather.py \
  tests/distributed/test_tp_packed_checkpoint.py tests/distributed/test_moe_fp8.py \
  tests/distributed/test_load_full_state_dict.py tests/distributed/test_collective_order.py \
  tests/distributed/test_model_zoo.py || status=1
exit $status
