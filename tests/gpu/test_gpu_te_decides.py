"""What only real Transformer Engine on a GPU decides (one CUDA GPU, world size 1, in-process NCCL).

* FP8 state through a checkpoint: ``save_state`` (after an evaluation pass, A19) / ``load_state`` of an FSDP2 +
  FP8 model restores every FP8 scale and amax history without ``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE``; stock TE refuses its own
  delayed-scaling ``_extra_state`` while the package's safe loader reads it.
* Activation checkpointing under FP8 (transformers' ``gradient_checkpointing_enable``): the recompute runs
  its GEMMs in FP8 too (one more FP8 GEMM per TE Linear per step, no high-precision TE GEMM), same losses.
* FP8 GEMMs observed: every TE GEMM of a training step takes FP8 operands, and cuBLAS runs FP8 kernels
  (``torch.profiler`` kernel names).
* Token counts: which per-rank token counts TE's FP8 GEMMs accept and which they refuse, against the
  package's rule (``accel_fp8_fix.fixes.convert.fp8_shapes``: a multiple of 8, 16 in training on TN-only FP8 GEMMs) and its own check's message.

Skipped without CUDA, real TE or FP8 support (tests/support/real_te.py says why).
"""

from __future__ import annotations

import math
import os

import pytest

from support.real_te import GemmSpy, reset_accelerate, single_rank_process_group, te, torch  # noqa: E402

from torch import nn  # noqa: E402

from accel_fp8_fix.testing.training import BlockStack  # noqa: E402

DIM, HIDDEN, TOKENS = 128, 256, 32
RECIPE = {"fp8_format": "HYBRID", "amax_history_len": 16, "amax_compute_algo": "max"}


def _stack():
    return BlockStack(DIM, HIDDEN, 2, DIM)


@pytest.fixture(scope="module")
def single_rank():
    yield from single_rank_process_group()


def _accelerator(wrap=("Block",)):
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin, TERecipeKwargs

    reset_accelerate()
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=list(wrap))
    return Accelerator(mixed_precision="fp8", fsdp_plugin=plugin, kwargs_handlers=[TERecipeKwargs(**RECIPE)])


def _batch(seed, tokens=TOKENS):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(tokens, DIM, device="cuda", generator=g), torch.randn(tokens, DIM, device="cuda", generator=g)


def _train(acc, model, opt, steps):
    x, y = _batch(1)
    losses = []
    for _ in range(steps):
        loss = nn.functional.mse_loss(model(x).float(), y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    torch.cuda.synchronize()
    return losses


# -- checkpoints ------------------------------------------------------------------------------------------------
def test_fp8_state_survives_save_state_and_load_state_without_unsafe_pickle(single_rank, tmp_path):
    from accel_fp8_fix.fixes.convert.fp8_state import fp8_state_tensors

    assert "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE" not in os.environ
    acc = _accelerator()
    torch.manual_seed(0)
    model = _stack().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    _train(acc, model, opt, 3)
    model.eval()  # an evaluation pass before saving: TE runs it without FP8 and would then save no FP8 state (A19)
    with torch.no_grad():
        model(_batch(2)[0])
    model.train()
    acc.save_state(str(tmp_path / "ckpt"))
    saved_fp8 = {k: v.detach().clone() for k, v in fp8_state_tensors(model).items()}
    saved_weights = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    assert saved_fp8 and any(k.endswith("scale") and bool((v != 1).any()) for k, v in saved_fp8.items()), \
        "training moved no FP8 scale: nothing to check"

    acc = _accelerator()
    torch.manual_seed(123)  # another init: everything must come from the checkpoint
    fresh = _stack().cuda()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    fresh, fresh_opt = acc.prepare(fresh, fresh_opt)
    acc.load_state(str(tmp_path / "ckpt"))
    loaded_fp8 = fp8_state_tensors(fresh)
    assert sorted(loaded_fp8) == sorted(saved_fp8)
    assert [k for k in saved_fp8 if not torch.equal(loaded_fp8[k], saved_fp8[k])] == []
    assert [n for n, p in fresh.named_parameters() if not torch.equal(p.full_tensor(), saved_weights[n])] == []
    assert "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE" not in os.environ
    _train(acc, fresh, fresh_opt, 1)  # and it trains on from there
    reset_accelerate()


def test_stock_te_refuses_its_own_delayed_scaling_state_and_the_safe_loader_reads_it(single_rank):
    from transformer_engine.common.recipe import DelayedScaling, Format

    from accel_fp8_fix.fixes.convert.fp8_autocast import te_autocast
    from accel_fp8_fix.fixes.checkpoint.fp8_state_loading import install_safe_loading

    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=8)
    trained = te.Linear(64, 64).cuda()
    for _ in range(2):
        with te_autocast(te)(True, recipe, None):
            trained(torch.randn(16, 64, device="cuda", requires_grad=True)).sum().backward()
    state = trained.state_dict()
    with pytest.raises(RuntimeError, match="NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"):
        te.Linear(64, 64).cuda().load_state_dict(state)
    safe = te.Linear(64, 64).cuda()
    install_safe_loading(safe)
    safe.load_state_dict(state)
    for key in ("scaling_fwd", "scaling_bwd"):
        assert torch.equal(safe.fp8_meta[key].scale, trained.fp8_meta[key].scale), key
        assert torch.equal(safe.fp8_meta[key].amax_history, trained.fp8_meta[key].amax_history), key
    assert safe.fp8_meta["recipe"].amax_history_len == 8
    reset_accelerate()


# -- activation checkpointing -------------------------------------------------------------------------------------
def _llama_step_counts(checkpointing: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    acc = _accelerator(wrap=("LlamaDecoderLayer",))
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).cuda()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    routed = list(acc.accel_fp8_fix.checkpointing_routed)
    te_linears = [m for m in model.modules() if isinstance(m, te.Linear)]
    ids = torch.randint(0, 512, (2, 32), device="cuda", generator=torch.Generator(device="cuda").manual_seed(3))
    losses, spies = [], []
    for _ in range(3):
        with GemmSpy() as spy:
            loss = model(input_ids=ids, labels=ids).loss
            acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        spies.append((spy.calls, spy.fp8))
    torch.cuda.synchronize()
    fp8_on = all(m.fp8 for m in te_linears)
    reset_accelerate()
    return {"routed": routed, "te_linears": len(te_linears), "losses": losses, "gemms": spies, "fp8": fp8_on}


def test_activation_checkpointing_recomputes_in_fp8(single_rank):
    plain = _llama_step_counts(False)
    ckpt = _llama_step_counts(True)
    assert ckpt["routed"] and not plain["routed"], (ckpt["routed"], plain["routed"])
    assert plain["fp8"] and ckpt["fp8"] and plain["te_linears"] == ckpt["te_linears"] > 0
    n = plain["te_linears"]
    for (calls, fp8), (ckpt_calls, ckpt_fp8) in zip(plain["gemms"], ckpt["gemms"]):
        assert calls == fp8 == 3 * n, plain["gemms"]  # fprop, dgrad, wgrad per TE Linear, all FP8
        assert ckpt_calls == ckpt_fp8 == 4 * n, ckpt["gemms"]  # + the recomputed fprop, in FP8 as well
    # the recompute repeats the forward under the same FP8 scales: the same training, to rounding
    assert ckpt["losses"] == pytest.approx(plain["losses"], rel=1e-2), (plain["losses"], ckpt["losses"])


# -- FP8 GEMMs observed -----------------------------------------------------------------------------------------------
def test_every_te_gemm_of_a_training_step_is_fp8_and_cublas_runs_fp8_kernels(single_rank):
    from torch.profiler import ProfilerActivity, profile

    acc = _accelerator()
    torch.manual_seed(0)
    model = _stack().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    _train(acc, model, opt, 1)
    linears = [m for m in model.modules() if isinstance(m, te.Linear)]
    x, y = _batch(5)
    with GemmSpy() as spy, profile(activities=[ProfilerActivity.CUDA]) as prof:
        loss = nn.functional.mse_loss(model(x).float(), y)
        acc.backward(loss)
        torch.cuda.synchronize()
    opt.step()
    assert spy.calls == 3 * len(linears) and spy.fp8 == spy.calls, (spy.calls, spy.fp8, len(linears))
    kernels = sorted({e.name for e in prof.key_averages() if "gemm" in e.name.lower() or "xmma" in e.name.lower()
                      or "cutlass" in e.name.lower()})
    print("GEMM kernels:", *kernels, sep="\n  ")
    fp8_kernels = [k for k in kernels if any(tag in k.lower() for tag in ("e4m3", "e5m2", "fp8", "f8"))]
    assert fp8_kernels, f"no FP8 GEMM kernel among the CUDA kernels: {kernels}"
    reset_accelerate()


# -- token counts (last: a refused GEMM is TE's to report) -------------------------------------------------------
def test_token_counts_te_fp8_gemms_accept_and_refuse_match_the_package_rule(single_rank):
    from transformer_engine.common.recipe import DelayedScaling, Format

    from accel_fp8_fix.fixes.convert.fp8_autocast import te_autocast
    from accel_fp8_fix.fixes.convert.fp8_shapes import FP8_LEADING_MULTIPLE, WGRAD_TOKENS_MULTIPLE, install_token_check
    from accel_fp8_fix.internals.transformer_engine import fp8_gemms_tn_only

    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4)
    # training (forward + backward): TN-only FP8 GEMMs (Hopper) put the tokens in the weight-gradient GEMM's
    # leading dimension, which cuBLASLt wants a multiple of 16; any layout (Blackwell): TE's forward rule, 8
    multiple = math.lcm(FP8_LEADING_MULTIPLE, WGRAD_TOKENS_MULTIPLE) if fp8_gemms_tn_only() else FP8_LEADING_MULTIPLE
    verdicts, package = {}, {}
    for tokens in (4, 8, 12, 16, 20, 24, 40, 48):
        for checked, into in ((False, verdicts), (True, package)):
            linear = te.Linear(64, 64).cuda()
            if checked:
                install_token_check(linear, "blocks.0.fc1")
            try:
                with te_autocast(te)(True, recipe, None):
                    out = linear(torch.randn(tokens, 64, device="cuda", requires_grad=True))
                out.float().sum().backward()
                torch.cuda.synchronize()
                into[tokens] = "accepted"
            except Exception as exc:  # noqa: BLE001  (TE's own refusal, whatever its type)
                into[tokens] = f"refused: {type(exc).__name__}: {str(exc)[:120]}"
    print("TE FP8 GEMM token verdicts (training):", verdicts, "multiple", multiple)
    assert {t: v == "accepted" for t, v in verdicts.items()} == {t: t % multiple == 0 for t in verdicts}, verdicts
    # the package refuses exactly those, by name, at the forward (before TE's GEMM)
    assert {t: v == "accepted" for t, v in package.items()} == {t: t % multiple == 0 for t in package}, package
    assert all(v.startswith("refused: ValueError: accel_fp8_fix: blocks.0.fc1") for v in package.values()
               if v != "accepted"), package
    checked = te.Linear(64, 64).cuda()
    install_token_check(checked, "blocks.0.fc1")
    with torch.no_grad(), te_autocast(te)(True, recipe, None):  # no weight gradient: TE's forward rule only
        checked(torch.randn(24, 64, device="cuda"))
    with pytest.raises(ValueError, match="blocks.0.fc1"), te_autocast(te)(True, recipe, None):
        checked(torch.randn(12, 64, device="cuda"))
    reset_accelerate()
