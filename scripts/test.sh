#!/usr/bin/env bash
# Sets up, then runs the whole test suite (CPU only; multi-process tests on gloo). Takes the project's one test lock
# (/tmp/accel_fp8_fix.mp.lock, or $ACCEL_FP8_FIX_TEST_LOCK; 0 = none) so that two runners never share the cores:
# do not wrap it in another flock of the same file.
#
# With no arguments the suite runs as two pytest sessions side by side: the tests that start no multi-rank job
# (tests/unit and tests/rehearsal, whose TE-in-a-fresh-process checks use one-rank pools; tests/testbed, the test
# bed's own tests, whose launches of small functions in 2-3 ranks start no scenario and mostly wait on deadlines;
# the files of tests/network whose subprocesses
# are single interpreters: the GPU kit's and the wheels' — the kit's rank probe, test_gpu_kit_probe.py, runs in the
# other session; and the files whose launches are fresh interpreters by design: the ways in, the demo, the
# accelerate releases; ~5 minutes) beside the pooled multi-process layers, whose ranks leave a core idle ~20 % of
# the time (waiting on each other, starting, collecting). The side session's report is printed after the other's,
# and the command fails if either does (the pooled-equals-fresh check, tests/distributed/test_pool_agreement.py,
# covers the pooled launches: all in the other session). ACCEL_FP8_FIX_TEST_SPLIT=0 runs one session (as with
# arguments: `bash scripts/test.sh tests/unit` runs one layer). The whole-run tests — a training run killed and
# resumed, tests/distributed/test_fault_resume.py (~2.5 minutes of 4- and 2-rank launches with restarts) — are left
# out of the run with no arguments, as the convergence benchmark is: CI runs them in a phase of their own (.ci/run
# `resume`), and `bash scripts/test.sh tests/distributed/test_fault_resume.py` runs them here.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export OMP_NUM_THREADS=1
LOCK=${ACCEL_FP8_FIX_TEST_LOCK:-/tmp/accel_fp8_fix.mp.lock}
if [ "$LOCK" != 0 ]; then
  exec 9>"$LOCK"
  flock 9
fi
if [ $# -gt 0 ] || [ "${ACCEL_FP8_FIX_TEST_SPLIT:-1}" = 0 ]; then
  exec python -m pytest -q "$@"
fi
side=(tests/unit tests/rehearsal tests/testbed tests/network/test_gpu_kit.py tests/network/test_packaging.py tests/distributed/test_activation.py
      tests/distributed/test_demo.py tests/network/test_accelerate_versions.py)
whole_runs=(tests/distributed/test_fault_resume.py)
unit_log=$(mktemp "${TMPDIR:-/tmp}/accel_fp8_fix-unit.XXXXXX")
# the side session keeps fewer one-rank pools alive: the other session's ranks share the memory
ACCEL_FP8_FIX_TEST_POOLS=${ACCEL_FP8_FIX_TEST_UNIT_POOLS:-3} \
  python -m pytest -q "${side[@]}" "${whole_runs[@]/#/--ignore=}" >"$unit_log" 2>&1 &
unit_pid=$!
trap 'kill "$unit_pid" 2>/dev/null || true' EXIT INT TERM
status=0
# the pooled-equals-fresh check (run last) makes one fresh launch, in the leading file's environment: the files it
# cannot cover there are checked on the days they lead (tests/support/agreement.py; CI's low end checks every file)
ACCEL_FP8_FIX_TEST_AGREEMENT_LAUNCHES=${ACCEL_FP8_FIX_TEST_AGREEMENT_LAUNCHES:-1} \
  python -m pytest -q "${side[@]/#/--ignore=}" "${whole_runs[@]/#/--ignore=}" || status=$?
unit_status=0
wait "$unit_pid" || unit_status=$?
trap - EXIT INT TERM
echo
echo "=== the pool-free tests (${side[*]}), run beside the above: exit $unit_status ==="
cat "$unit_log"
rm -f "$unit_log"
[ "$status" -eq 0 ] && [ "$unit_status" -eq 0 ]
