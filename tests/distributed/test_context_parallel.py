"""Context parallelism on CPU (issue 31 item 1): the rehearsal's CPU ring attention (``rehearsal/context_parallel.py``)
puts the CPU flash-attention kernel into torch's CP handler table, so ``context_parallel`` runs torch's own ring on
gloo ranks. Before it, the first SDPA inside the context failed: "Operator
aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy registered".
CP attention must equal the same attention unsharded, forward and backward."""

import pytest

from support import cp_scenarios
from support import scenarios

PLAN = [
    ("sc_ring_attention", {"dtype": "float32", "causal": True, "load_balance": True}),
    ("sc_ring_attention", {"dtype": "float32", "causal": False, "load_balance": False}),
    ("sc_ring_attention", {"dtype": "bfloat16", "causal": True, "load_balance": True}),
    ("sc_ring_attention_refuses_a_mask", {}),
]


@pytest.fixture(scope="module")
def two():
    return scenarios.launch(cp_scenarios, PLAN, 2)


@pytest.mark.parametrize("entry", [0, 1, 2], ids=["fp32-causal-balanced", "fp32-full", "bf16-causal-balanced"])
def test_cp_attention_equals_unsharded_attention_forward_and_backward(two, entry):
    name, kwargs = PLAN[entry]
    bf16 = kwargs["dtype"] == "bfloat16"
    for f in scenarios.plan_facts(two, PLAN, name, kwargs):
        assert "scenario_error" not in f, f.get("scenario_error", "") + "\n" + "\n".join(f.get("traceback", []))
        assert f["installed"] and f["local_seq"] == cp_scenarios.SHAPE[2] // 2  # really sharded over 2 ranks
        # torch's ring called the CPU flash kernel per block, forward and backward
        assert f["ops"] == ["aten::_scaled_dot_product_flash_attention_for_cpu",
                            "aten::_scaled_dot_product_flash_attention_for_cpu_backward"], f["ops"]
        assert f["dtype"] == f"torch.{kwargs['dtype']}" and set(f["grad_dtypes"]) == {f"torch.{kwargs['dtype']}"}
        # fp32: the ring's log-sum-exp merge reorders the sums only; bf16: one bf16 rounding of each output
        # (2^-8 relative) on top of what the unsharded bf16 kernel rounds
        tolerance = 2 ** -7 * max(f["out_scale"], 1.0) if bf16 else 2e-6
        assert f["out_diff"] <= tolerance, (f["out_diff"], tolerance)
        assert max(f["grad_diffs"]) <= (2 * tolerance if bf16 else 1e-5), f["grad_diffs"]


def test_cp_attention_with_a_mask_is_refused_by_name(two):
    for f in scenarios.plan_facts(two, PLAN, "sc_ring_attention_refuses_a_mask"):
        assert f["error"] is not None and "accel_fp8_fix rehearsal: CPU ring attention with an attention mask" in \
            f["error"], f["error"]
