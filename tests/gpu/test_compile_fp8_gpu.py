"""FP8 under accelerate's torch.compile setting on REAL Transformer Engine (one CUDA GPU, world size 1), against
the same run uncompiled: FSDP2 + ``mixed_precision="fp8"`` through the patched ``prepare``, a tiny Qwen2, with
accelerate's ``dynamo_backend`` set as ``dynamo_config: {dynamo_backend: INDUCTOR}`` launches it
(``ACCELERATE_DYNAMO_BACKEND``). On the CPU rehearsal the same comparison is tests/distributed/test_compile_fp8.py;
here it runs on TE's CUDA kernels, where compile is left to run (nothing refuses it).

Asserted: compiled losses equal the uncompiled ones every step (FP8 rounding and inductor's fusions: 2 % relative),
the same number of TE GEMMs, all FP8, in both runs (TE's modules run eagerly behind dynamo's graph breaks). The
median step times after warm-up are recorded as test properties (``-rP`` / junit) — what compile buys on the GPU.

Skipped without CUDA, real TE or FP8 support (tests/support/real_te.py says why).
"""

from __future__ import annotations

import os
import statistics
import time

import pytest

from support.real_te import GemmSpy, reset_accelerate, single_rank_process_group, torch  # noqa: E402

VOCAB, TOKENS, STEPS, WARMUP = 256, (2, 64), 8, 3
RECIPE = {"fp8_format": "HYBRID", "amax_history_len": 16, "amax_compute_algo": "max"}


@pytest.fixture(scope="module")
def single_rank():
    yield from single_rank_process_group()


def _tiny_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False, attn_implementation="eager")
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config)


def _train(backend: str) -> dict:
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin, TERecipeKwargs
    from torch.distributed.fsdp import MixedPrecisionPolicy

    reset_accelerate()
    torch._dynamo.reset()
    saved = os.environ.get("ACCELERATE_DYNAMO_BACKEND")
    os.environ["ACCELERATE_DYNAMO_BACKEND"] = backend
    try:
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["Qwen2DecoderLayer"],
            mixed_precision_policy=MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32))
        acc = Accelerator(mixed_precision="fp8", fsdp_plugin=plugin, kwargs_handlers=[TERecipeKwargs(**RECIPE)])
        model = _tiny_qwen2().to(acc.device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt = acc.prepare(model, opt)
        assert acc.accel_fp8_fix.fp8_enabled
        g = torch.Generator().manual_seed(11)
        batches = [torch.randint(0, VOCAB, TOKENS, generator=g).to(acc.device) for _ in range(STEPS)]
        losses, step_s = [], []
        with GemmSpy() as spy:
            for ids in batches:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                loss = model(input_ids=ids, labels=ids).loss
                acc.backward(loss)
                opt.step()
                opt.zero_grad()
                torch.cuda.synchronize()
                step_s.append(time.perf_counter() - t0)
                losses.append(float(loss.detach()))
        return {"compiled": type(model).__name__, "losses": losses, "gemms": spy.calls, "fp8_gemms": spy.fp8,
                "median_step_s": statistics.median(step_s[WARMUP:]), "first_step_s": step_s[0]}
    finally:
        if saved is None:
            os.environ.pop("ACCELERATE_DYNAMO_BACKEND", None)
        else:
            os.environ["ACCELERATE_DYNAMO_BACKEND"] = saved
        torch._dynamo.reset()


def test_compiled_fp8_trains_like_the_uncompiled_run_on_real_te(single_rank, record_property):
    eager = _train("NO")
    compiled = _train("INDUCTOR")
    assert compiled["compiled"].endswith("OptimizedModule"), compiled["compiled"]
    for step, (lc, le) in enumerate(zip(compiled["losses"], eager["losses"])):
        assert lc == pytest.approx(le, rel=2e-2), f"step {step}: compiled {lc} vs uncompiled {le}"
    assert compiled["gemms"] == eager["gemms"] > 0
    assert compiled["fp8_gemms"] == compiled["gemms"] and eager["fp8_gemms"] == eager["gemms"]
    for name, run in (("uncompiled", eager), ("compiled", compiled)):
        record_property(f"{name}_median_step_s", run["median_step_s"])
        record_property(f"{name}_first_step_s", run["first_step_s"])
    print(f"median step after {WARMUP} warm-up steps: uncompiled {eager['median_step_s']:.4f} s, compiled "
          f"{compiled['median_step_s']:.4f} s (first step {compiled['first_step_s']:.1f} s with compilation)")
