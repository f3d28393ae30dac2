"""FP8 (FSDP2, tiny Qwen2, 2 ranks) under accelerate's torch.compile setting (``dynamo_backend: INDUCTOR``),
against the same run uncompiled. One launch, with the collective-order audit on (its recorder declares
``ignore_compile_internals``, so dynamo compiles under it). Before the fixes the first forward failed in this
package's forward wrapper: ``TypeError: Qwen2ForCausalLM.forward() got multiple values for argument 'input_ids'``
(the compiled forward is a function set on the ``OptimizedModule``, and the wrapper passed the module to it); then,
in the rehearsal only, in transformers' forward: ``arange() ... got (int, device=torch.Size)`` — dynamo compiled the
rehearsal mode's ``__torch_function__`` as a frame of its own and reused the code compiled for
``Tensor.shape.__get__`` for ``Tensor.device.__get__`` (no guard on a method-wrapper argument); the rehearsal now
keeps its own functions out of dynamo's frame compilation (cuda_as_cpu._skip_dynamo_frames)."""

import pytest

from support import compile_scenarios
from support import scenarios

PLAN = [("sc_fsdp2_fp8_compile", {"backend": "INDUCTOR"}), ("sc_fsdp2_fp8_compile", {"backend": "NO"})]


@pytest.fixture(scope="module")
def runs():
    results = scenarios.launch(compile_scenarios, PLAN, 2)
    return (scenarios.facts_of(results, scenarios.key_of(PLAN, "sc_fsdp2_fp8_compile", {"backend": "INDUCTOR"})),
            scenarios.facts_of(results, scenarios.key_of(PLAN, "sc_fsdp2_fp8_compile", {"backend": "NO"})))


def test_the_uncompiled_fp8_run_trains(runs):
    for f in runs[1]:
        assert f["error"] is None and f["fp8_enabled"] and len(f["losses"]) == 3
        assert f["fp8_gemms_fwd"] == 14 * 3 and f["non_fp8_gemms"] == 0  # 7 Linears x 2 layers, every step


def test_the_compiled_model_is_prepared_with_fp8_and_never_fails_in_the_packages_wrapper(runs):
    for f in runs[0]:
        assert f["compiled"] == "FSDPOptimizedModule" and f["fp8_enabled"]
        assert "multiple values for argument" not in (f["error"] or "")
        assert "fp8_autocast.py" not in "\n".join(f.get("traceback", [])[-3:])
        assert f["dynamo"]["frames_total"] > 0  # dynamo really ran (it is not skipped)


def test_compiled_fp8_trains_and_its_losses_match_the_uncompiled_run_every_step(runs):
    compiled, eager = runs
    for c, e in zip(compiled, eager):
        assert c["error"] is None, c["error"] + "\n" + "\n".join(c.get("traceback", []))
        assert len(c["losses"]) == len(e["losses"]) == 3
        for step, (lc, le) in enumerate(zip(c["losses"], e["losses"])):
            assert lc == pytest.approx(le, rel=1e-4, abs=1e-5), f"step {step}: compiled {lc} vs uncompiled {le}"
        assert c["losses"][-1] != c["losses"][0]  # it trains: the parameters moved


def test_compiled_fp8_runs_every_gemm_in_fp8_as_the_uncompiled_run_does(runs):
    compiled, eager = runs
    for c, e in zip(compiled, eager):
        # TE's modules run eagerly behind dynamo's graph breaks (TE marks them torch._dynamo.disable): the same
        # FP8 GEMMs as uncompiled, forward (7 Linears x 2 layers x 3 steps) and backward (dgrad + wgrad)
        assert c["fp8_gemms_fwd"] == e["fp8_gemms_fwd"] == 14 * 3
        assert c["fp8_gemms_bwd"] == e["fp8_gemms_bwd"] == 2 * 14 * 3
        assert c["non_fp8_gemms"] == e["non_fp8_gemms"] == 0


def test_dynamo_compiles_graphs_under_the_collective_order_audit(runs):
    compiled, eager = runs
    for c, e in zip(compiled, eager):
        assert c["dynamo"]["graphs"] > 0 and c["dynamo"]["frames_ok"] > 0  # really compiled, audit on
        assert e["dynamo"]["frames_total"] == 0  # the uncompiled run compiles nothing
        # the audit saw the steps' collectives (FSDP2's all-gathers / reduce-scatters), compiled or not; the
        # launch itself fails if the ranks' sequences diverge
        assert c["audited_collectives"] and c["audited_collectives"] == e["audited_collectives"]
