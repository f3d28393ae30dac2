"""Step time of FP8 training under accelerate's torch.compile setting against the same run uncompiled.

FSDP2 + FP8 (``mixed_precision="fp8"``) through the patched ``prepare`` on 2 gloo ranks, the run the tests make
(``accel_fp8_fix.testing.training.fsdp2_fp8_compile_run``: a tiny Qwen2, hidden 64, 2 layers, vocabulary 128, 2 x 8
tokens per rank), TE's real Python over the CPU kernel shim + CPU rehearsal (``ACCEL_FP8_FIX_REHEARSAL=1``), the
collective-order audit on (as in the tests), launched by ``accel_fp8_fix.testing.run_distributed``. ``INDUCTOR`` is
what ``dynamo_config: {dynamo_backend: INDUCTOR}`` launches with (``ACCELERATE_DYNAMO_BACKEND``); ``NO`` is the
uncompiled run. Each backend runs in its own launch (fresh processes, fresh dynamo caches).

Per backend: the first step (compilation included), the median of the steps after ``--warmup`` steps, the losses
(compiled and uncompiled must agree), FP8 GEMMs, dynamo's graphs and graph breaks. TE's modules run eagerly
behind graph breaks (TE marks them ``torch._dynamo.disable``): what compile can buy is the code between them
(embedding, norms, rotary, attention softmax, the loss, FSDP2's plumbing stays eager). On the CPU rehearsal the
figures say whether compiling costs or buys step time around TE's eager modules, not what a GPU would see.

Run: ``python benchmarks/compile_fp8.py [--steps 13] [--warmup 3]`` (~2 min on the 2-core machine).
Prints a markdown table and one ``BENCH_ROW {json}`` line per backend.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def run(backend: str, steps: int, warmup: int) -> dict:
    from accel_fp8_fix.testing import run_distributed
    from accel_fp8_fix.testing.training import ENV_FIXED, fsdp2_fp8_compile_run

    t0 = time.perf_counter()
    ranks = run_distributed(fsdp2_fp8_compile_run, 2, args=(backend, steps), env=ENV_FIXED, timeout=900.0,
                            collective_timeout=120.0, init_process_group=False)
    wall = time.perf_counter() - t0
    f = ranks[0]
    if f["error"]:
        raise SystemExit(f"{backend}: {f['error']}\n" + "\n".join(f.get("traceback", [])))
    # a step ends when its slowest rank ends: per step, the max over the ranks
    per_step = [max(r["step_s"][i] for r in ranks) for i in range(steps)]
    return {"backend": backend, "first_step_s": per_step[0], "median_step_s": statistics.median(per_step[warmup:]),
            "timed_steps": steps - warmup, "losses": f["losses"], "fp8_gemms_fwd": f["fp8_gemms_fwd"],
            "fp8_gemms_bwd": f["fp8_gemms_bwd"], "non_fp8_gemms": f["non_fp8_gemms"],
            "graphs": f["dynamo"]["graphs"], "graph_breaks": f["dynamo"]["graph_breaks"], "launch_s": wall}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=13)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args(argv)
    if args.steps <= args.warmup:
        ap.error("--steps must exceed --warmup")
    rows = [run(b, args.steps, args.warmup) for b in ("NO", "INDUCTOR")]
    eager, compiled = rows
    worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(compiled["losses"], eager["losses"]))
    print("| backend | first step (s) | median step after warm-up (s) | FP8 GEMMs fwd/bwd (non-FP8) "
          "| graphs / breaks |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['backend']} | {r['first_step_s']:.2f} | {r['median_step_s']:.3f} | "
              f"{r['fp8_gemms_fwd']}/{r['fp8_gemms_bwd']} ({r['non_fp8_gemms']}) | "
              f"{r['graphs']} / {r['graph_breaks']} |")
    print(f"\ncompiled / uncompiled median step: {compiled['median_step_s'] / eager['median_step_s']:.2f}; "
          f"largest relative loss difference over {args.steps} steps: {worst:.1e}")
    for r in rows:
        print("BENCH_ROW " + json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
