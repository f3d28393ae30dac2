"""FP8 under accelerate's torch.compile setting (``dynamo_backend: INDUCTOR``, FSDP2, a tiny Qwen2) for
tests/distributed/test_compile_fp8.py. Each runs inside a rank of ``run_distributed`` and returns facts."""

from __future__ import annotations

import os
import time

from . import scenarios

VOCAB = 128
TOKENS = (2, 8)  # 16 tokens per rank: a multiple of 8, as TE's FP8 GEMMs need


def tiny_qwen2(seed: int = 0):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, attn_implementation="eager")
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def sc_fsdp2_fp8_compile(rank, world_size, backend="INDUCTOR", steps=3, lr=1e-3):
    """FSDP2 + FP8 through the patched prepare with accelerate's dynamo setting ``backend`` ("NO": the
    uncompiled comparison), set as ``accelerate launch`` sets it (``ACCELERATE_DYNAMO_BACKEND``).
    Facts: the error, if any (with its type), losses, per-step wall time, FP8 GEMM counts."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from torch._dynamo.utils import counters

    scenarios.ensure_rehearsal(True)
    counters.clear()  # dynamo's counters are per process: count this scenario's compilation only
    os.environ["ACCELERATE_DYNAMO_BACKEND"] = backend  # what dynamo_config: {dynamo_backend: ...} launches with
    acc = scenarios.make_accelerator(fsdp=True, mixed_precision="fp8", wrap_cls=["Qwen2DecoderLayer"],
                             mixed_precision_policy=MixedPrecisionPolicy(param_dtype=torch.float32,
                                                                         reduce_dtype=torch.float32))
    facts = {"dynamo_backend": str(acc.state.dynamo_plugin.backend), "error": None, "losses": [], "step_s": []}
    model = tiny_qwen2(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(11)
    batches = [torch.randint(0, VOCAB, (world_size,) + TOKENS, generator=g)[rank] for _ in range(steps)]
    try:
        model, opt = acc.prepare(model, opt)
        facts["compiled"] = type(model).__name__
        facts["fp8_enabled"] = acc.accel_fp8_fix.fp8_enabled
        scenarios.te_reset()
        recorder = _audit_recorder()
        audited_before = len(recorder.records) if recorder is not None else None
        for ids in batches:
            t0 = time.perf_counter()
            loss = model(input_ids=ids, labels=ids).loss
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            facts["step_s"].append(time.perf_counter() - t0)
            value = loss.detach().clone()
            dist.all_reduce(value)
            facts["losses"].append(float(value) / world_size)
        # collectives the collective-order audit saw during the steps (None: no audit in this launch)
        facts["audited_collectives"] = len(recorder.records) - audited_before if recorder is not None else None
    except Exception as exc:  # noqa: BLE001
        facts["error"] = scenarios.err(exc)
        facts["error_type"] = type(exc).__name__
        import traceback

        facts["traceback"] = traceback.format_exc().splitlines()[-60:]
    stats = scenarios.te_stats()

    facts["dynamo"] = {"graphs": counters["stats"].get("unique_graphs", 0),
                       "frames_ok": counters["frames"].get("ok", 0), "frames_total": counters["frames"].get("total", 0),
                       "graph_breaks": sum(counters["graph_break"].values()),
                       "break_reasons": sorted(counters["graph_break"])[:8]}
    facts.update(fp8_gemms_fwd=stats["fp8_gemms_fwd"], fp8_gemms_bwd=stats["fp8_gemms_bwd"],
                 non_fp8_gemms=stats["non_fp8_gemms"])
    try:
        import torch._dynamo

        torch._dynamo.reset()
    except Exception:  # noqa: BLE001
        pass
    return facts


def _audit_recorder():
    """The collective-order audit's recorder of this rank (None when the launch runs without the audit)."""
    from accel_fp8_fix.diagnostics import collective_order

    return collective_order._installed.get("recorder")


# The defaults scenarios.launch(this module, plan, world_size) takes where its call does not say.
# Launched with the collective-order audit: its recorder declares ``ignore_compile_internals`` (before, its
# ``TorchDispatchMode`` made dynamo skip every frame — "non-infra torch dispatch mode present",
# torch/_dynamo/convert_frame.py — so nothing compiled under it).
LAUNCH = {"env": scenarios.ENV_FIXED, "timeout": 240.0, "collective_timeout": 120.0}
