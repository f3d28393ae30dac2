"""FP8 all-gather under FSDP2 (fixes/all_gather/fp8_all_gather.py), switch on vs off, on 2 and 4 CPU ranks, in one run.

Each configuration is a real ``Accelerator(mixed_precision="fp8", fsdp_plugin=FSDP2, TERecipeKwargs(HYBRID delayed))``
on gloo ranks (``accel_fp8_fix.testing.run_distributed``), Transformer Engine's real Python over the CPU kernel shim
(``ACCEL_FP8_FIX_REHEARSAL=1``), ``ACCELERATE_FP8_ALL_GATHER=fp8`` (on) or ``high_precision`` (off), the scenario
``sc_train`` of tests/support/fp8_all_gather_scenarios.py. The model has only bias-free Linears (every parameter FSDP2
gathers is a converted weight), so the bytes divide by converted parameters exactly. Measured at the c10d layer
(``CollectiveSpy``, dispatch level: FSDP2's ``_allgather_base_``; Python level: ``all_reduce``), per rank, on the
last step (after warm-up):

* bytes all-gathered per converted parameter per step (all ranks' bytes of FSDP2's all-gather outputs, forward +
  backward re-gather with reshard_after_forward=True; the root unit is not resharded after forward) and per
  gathered parameter;
* packed weight-amax all-reduces per step (the switch's) and all ``all_reduce`` calls per step;
* peak bytes of unsharded weights held during forward: the storage of FSDP2's all-gather outputs (and inner
  tensors) alive at each TE module's forward, maximum over the step;
* the losses of each run.

Run: ``python benchmarks/fp8_all_gather.py [--dim 256 --depth 4 --worlds 2,4 --steps 3]`` (~2 min on 2 cores);
``--recipe block --dim 512``: Float8BlockScaling (128x128 tile scales ride in the gather; the head is ``dim`` wide so
every shard is whole tiles on 4 ranks).

``--moe``: packed MoE experts (fixes/all_gather/fp8_experts_gather.py), scenario ``sc_moe``: a Qwen3-MoE with a real model's
proportions (32 experts, top-8, experts ~85 % of the parameters; ``--family qwen3_moe_proportioned_6``: 6
experts), all-gathered bytes per step on vs off and their ratio, per FSDP2 ``param_dtype`` policy, and the losses.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(HERE), "tests")


def _scenarios():
    if TESTS not in sys.path:
        sys.path.insert(0, TESTS)
    from support import fp8_all_gather_scenarios, scenarios

    return fp8_all_gather_scenarios, scenarios


def _row(world, policy, mode, f, gathered_params):
    """``gathered_params``: parameter elements FSDP2 gathered in the last step (the switch-off run's element count:
    the same schedule), so the switch's scale bytes count against the parameters they serve."""
    last = f["per_step"][-1]
    weights = f["fp8_weight_numel"] or f["model_numel"]
    per_step = last["all_gathered_bytes"] / f["model_numel"]
    per_gather = last["all_gathered_bytes"] / gathered_params
    return (f"| {world} | {policy} | {mode} | {per_step:.3f} | {per_gather:.5f} | {last['weight_amax_reductions']} | "
            f"{len(last['all_reduces'])} | {f['peak_unsharded_bytes_forward'] / 1024:.1f} | "
            f"{f['peak_unsharded_bytes_forward'] / weights:.3f} | {', '.join(f'{x:.4f}' for x in f['losses'])} |")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--recipe", choices=("delayed", "current", "block"), default="delayed")
    parser.add_argument("--moe", action="store_true", help="packed MoE experts (sc_moe) instead of a Linear stack")
    parser.add_argument("--family", default="qwen3_moe_proportioned")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    fp8_all_gather_scenarios, scenarios = _scenarios()
    if args.moe:
        return _moe(args, fp8_all_gather_scenarios, scenarios)
    print(f"recipe: {args.recipe}")
    print("| ranks | FSDP2 param_dtype | all_gather | bytes gathered / param / step | bytes / param / gather | "
          "weight-amax all-reduces / step | all_reduce calls / step | peak unsharded weights in forward (KiB) | "
          "peak / converted param (B) | losses |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for world in (int(w) for w in args.worlds.split(",")):
        out = args.dim if args.recipe == "block" else 16
        plan = [("sc_train", {"all_gather": mode, "policy": policy, "model": "linear_stack", "dim": args.dim,
                              "depth": args.depth, "steps": args.steps, "reference": False,
                              "recipe": args.recipe, "out": out,
                              # block scaling: 16 tokens a rank at least (TE's block-scaled GEMM shape rule)
                              "global_batch": 64 if args.recipe == "block" else 32})
                for policy in ("bf16", "fp32") for mode in ("high_precision", "fp8")]
        print(f"running {world} ranks ...", file=sys.stderr, flush=True)
        results = scenarios.launch(fp8_all_gather_scenarios, plan, world, timeout=900.0)
        for key, (name, kwargs) in zip(scenarios.result_keys(plan), plan):
            facts = [r[key] for r in results]
            for rank, f in enumerate(facts):
                if "scenario_error" in f:
                    raise SystemExit(f"rank {rank}: {f['scenario_error']}\n" + "\n".join(f["traceback"]))
            if kwargs["all_gather"] != "fp8":  # first in each policy's pair
                gathered_params = facts[0]["per_step"][-1]["all_gathered_numel"]
            mode = "fp8" if kwargs["all_gather"] == "fp8" else "high precision"
            print(_row(world, kwargs["policy"], mode, facts[0], gathered_params))
    return 0


def _moe(args, fp8_all_gather_scenarios, scenarios):
    recipe = "current" if args.recipe == "block" else args.recipe
    print(f"model: {args.family}; recipe: {recipe}")
    print("| ranks | FSDP2 param_dtype | all_gather | bytes gathered / step (all ranks) | on / off | experts' share of "
          "parameters | experts gathered in FP8 | weight-amax all-reduces / step | losses |")
    print("|---|---|---|---|---|---|---|---|---|")
    for world in (int(w) for w in args.worlds.split(",")):
        plan = [("sc_moe", {"all_gather": mode, "policy": policy, "family": args.family, "recipe": recipe,
                            "steps": args.steps, "reference": False})
                for policy in ("bf16", "fp32") for mode in ("high_precision", "fp8")]
        print(f"running {world} ranks ...", file=sys.stderr, flush=True)
        results = scenarios.launch(fp8_all_gather_scenarios, plan, world, timeout=900.0)
        off = None
        for key, (name, kwargs) in zip(scenarios.result_keys(plan), plan):
            f = results[0][key]
            if "scenario_error" in f:
                raise SystemExit(f"{f['scenario_error']}\n" + "\n".join(f["traceback"]))
            last = f["per_step"][-1]
            if kwargs["all_gather"] != "fp8":
                off = last["all_gathered_bytes"]
            ratio = last["all_gathered_bytes"] / off
            print(f"| {world} | {kwargs['policy']} | {kwargs['all_gather']} | {last['all_gathered_bytes']:,} | "
                  f"{ratio:.3f} | {f['expert_share']:.1%} | {len(f['gathered_experts'])} | "
                  f"{f['amax_reductions'] // len(f['losses'])} | {', '.join(f'{x:.4f}' for x in f['losses'])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
