#!/usr/bin/env python3
"""How far the TP and model-zoo runs fall from their one-process references, with the rehearsal's model of
Hopper's FP8 fast accumulation on and off, against the step-0 tolerance the tests use (tests/support/tolerances.py).

    python scripts/fast_accum_deviations.py            # both modes (takes the test lock; ~6 min on 2 cores)
    python scripts/fast_accum_deviations.py --mode on  # one

Prints one row per case: the worst rank's relative deviation at step 0, over all steps, of the clipped grad
norms, and the step-0 tolerance with the fast-accumulation term (docs/rehearsal.md "Measured on the suite").
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"


def _test_module(name):
    spec = importlib.util.spec_from_file_location(name, TESTS / "distributed" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rel(got, want):
    return max(abs(g - w) / abs(w) for g, w in zip(got, want))


def measure() -> None:
    """The rows of this process's mode (ACCEL_FP8_FIX_REHEARSAL_FAST_ACCUM as set)."""
    sys.path.insert(0, str(TESTS))
    from support import launcher, scenarios, tolerances, tp_scenarios, zoo_scenarios

    zoo, tp = _test_module("test_model_zoo"), _test_module("test_tp_fp8")
    mode = "on" if tolerances.fast_accum_on() else "off"
    cases = []
    zoo_plan = [(n, {**kw, "out_dir": None}) for n, kw in zoo.PLAN_2D + zoo.PLAN_OTHER
                if kw.get("precision", "fp8") == "fp8"]
    for key, (_, kw) in zip(scenarios.result_keys(zoo_plan), zoo_plan):
        cases.append((f"zoo {kw['family']}-{kw['layout']}", key, zoo_scenarios.LAYOUTS[kw["layout"]][2] or 1, 2e-4))
    zoo_results = scenarios.launch(zoo_scenarios, zoo_plan, 4)
    tp_plans = {2: tp.TWO_RANK_PLAN[:1], 4: tp.FOUR_RANK_PLAN}
    tp_results = {w: scenarios.launch(tp_scenarios, plan, w) for w, plan in tp_plans.items()}
    rows = [(name, scenarios.facts_of(zoo_results, key), tp_size, exact) for name, key, tp_size, exact in cases]
    for w, plan in tp_plans.items():
        for key, (_, kw) in zip(scenarios.result_keys(plan), plan):
            rows.append((f"tp_fp8 {w} ranks {kw or 'tp 2'}", scenarios.facts_of(tp_results[w], key), kw.get("tp", 2), 1e-5))
    print(f"\nfast accumulation {mode}\n")
    print("| case | step 0 | all steps | grad norms | step-0 tolerance |")
    print("|---|---|---|---|---|")
    for name, facts, tp_size, exact in rows:
        step0 = max(_rel(f["losses"][:1], f["reference"][:1]) for f in facts)
        steps = max(_rel(f["losses"], f["reference"]) for f in facts)
        norms = max(_rel(f["grad_norms"], f["reference_grad_norms"]) for f in facts)
        tol = tolerances.step0_rel(exact, tp_size, facts[0]["row_parallel_ks"])
        print(f"| {name} | {step0:.2e} | {steps:.2e} | {norms:.2e} | {tol:.2e} |")
    launcher.close_all()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("on", "off", "both"), default="both")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        measure()
        return 0
    lock = os.environ.get("ACCEL_FP8_FIX_TEST_LOCK", "/tmp/accel_fp8_fix.mp.lock")
    for mode in (("on", "off") if args.mode == "both" else (args.mode,)):
        env = {**os.environ, "ACCEL_FP8_FIX_REHEARSAL_FAST_ACCUM": "1" if mode == "on" else "0", "OMP_NUM_THREADS": "1"}
        command = [sys.executable, __file__, "--child"]
        if lock != "0":
            command = ["flock", lock, *command]
        code = subprocess.call(command, env=env, cwd=ROOT)
        if code:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
