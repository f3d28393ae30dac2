"""Which layout for an MoE: memory and bytes on the wire per rank, FSDP2 x TP (experts replicated or TP-sharded) vs
FSDP2 x EP vs FSDP2 alone, in one run on 4 CPU ranks.

transformers 5.25's default TP plans for Qwen3-MoE and Mixtral no longer shard the experts: under ``tp_size`` each
TP rank holds and runs every expert whole (the package serves them in FP8, replicated on ``tp``). The explicit
``moe_tp_experts`` plan (deprecated, "removal in v5.28.0") shards each expert's intermediate dim over TP; expert
parallelism (``DistributedConfig(ep_size=...)``) places whole experts on ranks and moves tokens with all-to-all.
Each row: a Qwen3-MoE with a real model's proportions (tests/support/fp8_all_gather_scenarios.py,
``qwen3_moe_proportioned``: 32 experts, top-8, experts ~85 % of the parameters), prepared by the package in FP8
(delayed scaling, FSDP2 param_dtype bf16, the FP8 all-gather off), 2 steps on Transformer Engine's Python over the
CPU shim; measured on rank 0 at the c10d dispatch layer (``CollectiveSpy``) on the last step, and the bytes of the
parameters the rank holds (its shards; with FSDP2 the unsharded weights exist only while a unit runs).

Run: ``python benchmarks/moe_layouts.py`` (~2 min on 2 cores). Figures: README "Mixture-of-experts" and
docs/benchmarks.md, "MoE layouts".
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(HERE), "tests")
LAYOUTS = {  # name: (sc_moe keyword arguments, what it is)
    "FSDP2 4": ({"dp_shard": 4}, "experts sharded by FSDP2 over 4 ranks"),
    "FSDP2 2 x TP 2, experts replicated (5.25 default plan)": (
        {"dp_shard": 2, "tp": 2, "experts_tp": "default"}, "each TP rank holds and runs every expert"),
    "FSDP2 2 x TP 2, moe_tp_experts (explicit plan)": (
        {"dp_shard": 2, "tp": 2, "experts_tp": "tp"}, "each TP rank holds I / 2 of every expert"),
    "FSDP2 4 x EP 2 (DistributedConfig(ep_size=2))": ({"ep": 2}, "each EP rank holds half the experts, whole"),
}
OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


def main() -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if TESTS not in sys.path:
        sys.path.insert(0, TESTS)
    from support import fp8_all_gather_scenarios, scenarios

    plan = [("sc_moe", {"all_gather": "high_precision", "policy": "bf16", "family": "qwen3_moe_proportioned",
                        "recipe": "delayed", "steps": 2, "reference": False, **kwargs})
            for kwargs, _ in LAYOUTS.values()]
    print("running 4 ranks ...", file=sys.stderr, flush=True)
    results = scenarios.launch(fp8_all_gather_scenarios, plan, 4, timeout=900.0)
    print("| layout | parameters held / rank (MiB) | experts held / rank (MiB) | "
          + " | ".join(f"{op} / step (MiB)" for op in OPS) + " | experts in FP8 | losses |")
    print("|---|---|---|" + "---|" * len(OPS) + "---|---|")
    for key, name in zip(scenarios.result_keys(plan), LAYOUTS):
        f = results[0][key]
        if "scenario_error" in f:
            raise SystemExit(f"{name}: {f['scenario_error']}\n" + "\n".join(f["traceback"]))
        by_op = f["per_step"][-1]["bytes_by_op"]
        mib = lambda b: f"{b / 2 ** 20:.2f}"  # noqa: E731
        print(f"| {name} | {mib(f['param_bytes_held'])} | {mib(f['expert_bytes_held'])} | "
              + " | ".join(mib(by_op.get(op, 0)) for op in OPS)
              + f" | {len(f['experts'])} | {', '.join(f'{x:.4f}' for x in f['losses'])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
