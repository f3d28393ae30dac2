#!/usr/bin/env bash
# The main job: sets up, then trains the demo with FSDP2 + TE FP8 on 4 CPU processes (gloo, TE's real Python on the CPU kernel shim).
# DEMO_PATCHES=off runs the same with accel_fp8_fix disabled, to show what stock accelerate does.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export ACCEL_FP8_FIX_REHEARSAL=1 OMP_NUM_THREADS=1
if [ "${DEMO_PATCHES:-on}" = "off" ]; then export ACCEL_FP8_FIX=0; fi
accelerate launch --config_file examples/fsdp2_tp_fp8.yaml --main_process_port 0 examples/demo.py "${DEMO_STEPS:-8}"
