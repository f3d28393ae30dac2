"""FP8 share of an MoE training step's GEMM FLOPs, before and after the experts ran on TE grouped GEMMs
(fixes/convert/moe_experts.py), in one run.

A real ``Accelerator(mixed_precision="fp8", FSDP2 plugin, TERecipeKwargs(HYBRID delayed))`` on 2 gloo ranks,
Transformer Engine 2.20.2's Python over the CPU kernel shim; the model is transformers' ``Qwen3MoeForCausalLM`` with
a real MoE's proportions (tests/support/moe_scenarios.py ``_proportioned_qwen3_moe``: 32 experts, top-8, expert MLP
32 of hidden 64 — Qwen3-30B-A3B has 128 experts, top-8, 768 of 2048). "Before": the same prepare with the experts
left to transformers (what the package did before issue 19); "after": the package's prepare as it is. Measured on
the last of 2 steps, rank 0 (scenario ``sc_gemm_share``; 8 x 64 tokens a rank, ~128 rows an expert): every TE GEMM from its operands (2 m n k, FP8 when both
operands are TE quantized tensors; a grouped GEMM per group), every other matmul at the dispatcher (aten
mm / addmm / bmm / baddbmm / _grouped_mm: transformers' experts, the routers, lm_head).

Run: ``python benchmarks/moe_fp8_share.py`` (~1 min on 2 cores).
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(HERE), "tests")


def _scenarios():
    if TESTS not in sys.path:
        sys.path.insert(0, TESTS)
    from support import moe_scenarios, scenarios

    return moe_scenarios, scenarios


def main() -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    moe_scenarios, scenarios = _scenarios()
    plan = [("sc_gemm_share", {"experts": False}), ("sc_gemm_share", {"experts": True})]
    results = scenarios.launch(moe_scenarios, plan, 2)
    print("| experts | GEMM MFLOP / step | FP8 | high precision | FP8 share of GEMM FLOPs | experts on TE grouped GEMMs |")
    print("|---|---|---|---|---|---|")
    for key, (name, kwargs) in zip(scenarios.result_keys(plan), plan):
        f = results[0][key]
        if "scenario_error" in f:
            raise SystemExit(f"{f['scenario_error']}\n" + "\n".join(f["traceback"]))
        total = f["fp8_flops"] + f["high_flops"]
        label = "TE grouped GEMMs (this package)" if kwargs["experts"] else "transformers' loop (before)"
        print(f"| {label} | {total / 1e6:.1f} | {f['fp8_flops'] / 1e6:.1f} | {f['high_flops'] / 1e6:.1f} | "
              f"{f['fp8_flops'] / total:.1%} | {len(f['experts'])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
