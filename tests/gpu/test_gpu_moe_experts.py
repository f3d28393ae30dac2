"""MoE experts on TE grouped GEMMs (fixes/convert/moe_experts.py) on REAL Transformer Engine: one CUDA GPU, world size 1,
through accelerate's FSDP2 ``prepare`` with the fixes active.

What the CPU rehearsal cannot prove: TE's CUDA ``split_quantize`` and cuBLAS grouped GEMM (``te_general_grouped_gemm``)
on per-expert views of the 3-D parameters, the FP8 padding of each expert's rows, and the training loss against
the bf16 run. Skipped without CUDA, real TE or FP8 support (tests/support/real_te.py says why).
"""

from __future__ import annotations


import pytest

from support.real_te import GemmSpy, reset_accelerate, single_rank_process_group, torch  # noqa: E402
from support import tolerances  # noqa: E402


@pytest.fixture(scope="module")
def single_rank():
    yield from single_rank_process_group()


def _train(mixed_precision: str, steps: int = 4, all_gather: bool = False):
    import os

    import transformers as tf
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin, TERecipeKwargs

    reset_accelerate()
    config = tf.Qwen3MoeConfig(vocab_size=1024, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2,
                               moe_intermediate_size=128, decoder_sparse_step=1, max_position_embeddings=128,
                               tie_word_embeddings=False)
    torch.manual_seed(0)
    model = tf.Qwen3MoeForCausalLM(config).cuda()
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["Qwen3MoeDecoderLayer"])
    handlers = [TERecipeKwargs(fp8_format="HYBRID", amax_history_len=16, amax_compute_algo="max")]
    acc = Accelerator(mixed_precision=mixed_precision, fsdp_plugin=plugin,
                      kwargs_handlers=handlers if mixed_precision == "fp8" else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    os.environ["ACCELERATE_FP8_ALL_GATHER"] = "fp8" if all_gather else "high_precision"
    try:
        model, opt = acc.prepare(model, opt)
    finally:
        os.environ.pop("ACCELERATE_FP8_ALL_GATHER", None)
    ids = torch.randint(0, 1024, (4, 100), device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    losses = []
    with GemmSpy("te_general_grouped_gemm") as spy:
        for _ in range(steps):
            loss = model(input_ids=ids, labels=ids).loss  # 400 tokens x top-2 over 8 experts: uneven, padded rows
            acc.backward(loss)
            acc.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
    setup = getattr(acc, "accel_fp8_fix", None)
    experts = list(setup.conversion.experts) if setup is not None and mixed_precision == "fp8" else []
    names = sorted(n for n, _ in model.named_parameters())
    gathered = list(setup.all_gather.experts) if setup is not None and setup.all_gather is not None else []
    return {"losses": losses, "grouped": spy.calls, "grouped_fp8": spy.fp8, "experts": experts, "names": names,
            "gathered_experts": gathered}


def test_experts_train_in_fp8_on_te_grouped_gemms_like_the_bf16_run(single_rank):
    fp8 = _train("fp8")
    bf16 = _train("bf16")
    assert fp8["experts"] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    # 2 layers x 2 projections: forward, dgrad, wgrad each one grouped GEMM, every one on FP8 operands
    assert fp8["grouped"] == 12 * 4 and fp8["grouped_fp8"] == fp8["grouped"]
    assert bf16["grouped"] == 0  # stock: transformers' own experts
    assert fp8["names"] == bf16["names"]  # the user's parameters, untouched
    assert all(torch.isfinite(torch.tensor(fp8["losses"])))
    assert fp8["losses"] == pytest.approx(bf16["losses"], rel=5e-2)


def test_experts_gathered_in_fp8_train_like_the_switch_off_run_on_real_te(single_rank):
    """``all_gather: fp8`` (fixes/all_gather/fp8_experts_gather.py): each expert's weight reaches TE's CUDA grouped GEMM as a
    Float8Tensor built from the gathered bytes and its own scale (TE's QuantizedTensor weight path, no second
    quantization), dgrad's transposed copy derived by TE; losses as with the experts gathered in bf16."""
    on = _train("fp8", all_gather=True)
    off = _train("fp8")
    assert on["gathered_experts"] == [f"model.layers.{i}.mlp.experts.{w}" for i in range(2)
                                      for w in ("gate_up_proj", "down_proj")]
    assert on["grouped"] == 12 * 4 and on["grouped_fp8"] == on["grouped"]
    assert all(torch.isfinite(torch.tensor(on["losses"])))
    assert on["losses"] == pytest.approx(off["losses"], rel=2e-2)


def test_gpt_oss_experts_transposed_with_biases_match_transformers_on_real_te():
    """GPT-OSS's ``[E, in, out]`` experts with biases on real TE grouped GEMMs: TE's CUDA GEMMs read a weight's
    storage, not its strides, so the package hands each expert's weight over transposed and contiguous — a strided
    view here would give an O(1) error in the non-FP8 pass. FP8 off: transformers' loop to fp32 GEMM rounding;
    FP8 on: within FP8's resolution."""
    import copy

    import transformer_engine.common.recipe as te_recipe
    import transformer_engine.pytorch as te
    import transformers as tf
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from accel_fp8_fix.fixes.convert.fp8_autocast import te_autocast
    from accel_fp8_fix.fixes.convert.moe_experts import convert_experts

    config = tf.GptOssConfig(hidden_size=256, intermediate_size=128, num_local_experts=8, num_experts_per_tok=2)
    torch.manual_seed(0)
    holder = torch.nn.Module()
    holder.experts = GptOssExperts(config).cuda()
    for p in holder.experts.parameters():
        torch.nn.init.normal_(p, std=0.05)
    ref = copy.deepcopy(holder.experts)
    ref.config = copy.copy(config)
    ref.config._experts_implementation = "eager"
    converted, skipped = convert_experts(holder, te)
    assert converted == ["experts"] and skipped == []
    g = torch.Generator("cuda").manual_seed(1)
    hidden = torch.randn(300, 256, device="cuda", generator=g)
    index = torch.randint(0, 8, (300, 2), device="cuda", generator=g)
    weights = torch.rand(300, 2, device="cuda", generator=g)

    def run(module, fp8):
        h = hidden.clone().requires_grad_()
        with te_autocast(te)(fp8, te_recipe.DelayedScaling(), None):
            out = module(h, index, weights)
        out.sum().backward()
        return [out.detach(), h.grad] + [p.grad.clone() for p in module.parameters(recurse=False)]

    want = run(ref, False)  # torch's own fp32 GEMMs (torch.backends.cuda.matmul.allow_tf32 is off by default)
    # TE runs its all-fp32 GEMMs in TF32 (cublaslt_gemm.cu): the output is two GEMMs deep, the gradients up to four
    tf32 = [tolerances.tf32_rel(2)] + [tolerances.tf32_rel(4)] * (len(want) - 1)
    for fp8, tolerance in ((False, tf32), (True, [0.15] * len(want))):
        holder.experts.zero_grad()
        got = run(holder.experts, fp8)
        for a, b, bound in zip(got, want, tolerance):
            assert float((a - b).norm() / b.norm()) < bound, fp8
