"""FP8 all-gather under FSDP2 (``ACCELERATE_FP8_ALL_GATHER=fp8``, fixes/all_gather/fp8_all_gather.py) on REAL Transformer
Engine: one CUDA GPU, world size 1 (FSDP2's all-gather is a local copy, its extension hooks run as on N GPUs).

What the CPU rehearsal cannot prove: TE's CUDA cast of the shard, TE's cuBLAS FP8 GEMM on a Float8Tensor weight
built from gathered bytes (Hopper: the transpose TE derives for dgrad; Blackwell: none), and the losses against the
switch-off run. Skipped without CUDA, real TE or FP8 support (tests/support/real_te.py says why).
"""

from __future__ import annotations

import os

import pytest

from support.real_te import GemmSpy, reset_accelerate, single_rank_process_group, te, torch  # noqa: E402

from torch import nn  # noqa: E402

from accel_fp8_fix.testing.training import Block  # noqa: E402


@pytest.fixture(scope="module")
def single_rank():
    yield from single_rank_process_group()


def _train(all_gather: str, recipe: str, steps: int = 4, post_optim_event: bool = False):
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    import accel_fp8_fix

    reset_accelerate()
    os.environ["ACCELERATE_FP8_ALL_GATHER"] = all_gather
    try:
        handler = accel_fp8_fix.te_recipe_kwargs(recipe=recipe, fp8_format="HYBRID")
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                                transformer_cls_names_to_wrap=["Block"])
        acc = Accelerator(mixed_precision="fp8", fsdp_plugin=plugin, kwargs_handlers=[handler])
        torch.manual_seed(0)
        model = nn.Sequential(Block(256, 512), Block(256, 512), nn.Linear(256, 64)).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt = acc.prepare(model, opt)
        g = torch.Generator(device="cuda").manual_seed(3)
        x = torch.randn(64, 256, device="cuda", generator=g)
        y = torch.randn(64, 64, device="cuda", generator=g)
        losses = []
        with GemmSpy() as gemms:
            for _ in range(steps):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
                acc.backward(loss)
                acc.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                if post_optim_event:  # FSDP2's all-gather streams then wait on this event, not the whole stream
                    event = torch.cuda.Event()
                    event.record()
                    model.set_post_optim_event(event)
                opt.zero_grad()
                losses.append(float(loss))
        setup = acc.accel_fp8_fix
        return {"losses": losses, "gemms": gemms.calls, "fp8_gemms": gemms.fp8,
                "gathered": list(setup.all_gather.weights) if setup.all_gather else [],
                "reductions": setup.all_gather.amax_reductions if setup.all_gather else 0,
                "param_dtypes": {str(p.dtype) for p in model.parameters()}}
    finally:
        os.environ.pop("ACCELERATE_FP8_ALL_GATHER", None)


@pytest.mark.parametrize("recipe", ["delayed", "current", "block"])
def test_fp8_all_gather_trains_like_the_switch_off_run_on_real_te(single_rank, recipe):
    """Block scaling: 128x128 tiles quantized on the shard (TE's CUDA kernel), gathered row-wise, the column-wise
    copy derived by TE's fp8_transpose for dgrad; no weight-amax all-reduce at all."""
    on = _train("fp8", recipe)
    off = _train("high_precision", recipe)
    # 4 Linears in blocks + the head; 1 packed weight-amax all-reduce per step (none with block scaling)
    assert len(on["gathered"]) == 5 and on["reductions"] == (0 if recipe == "block" else 4)
    assert on["gemms"] == on["fp8_gemms"] > 0 and off["gemms"] == off["fp8_gemms"]
    assert on["param_dtypes"] == off["param_dtypes"] == {"torch.float32"}
    assert all(torch.isfinite(torch.tensor(on["losses"])))
    assert on["losses"] == pytest.approx(off["losses"], rel=5e-2)
    if recipe == "current":  # the same whole-weight scale either way: the first step's FP8 math is the same
        assert on["losses"][0] == pytest.approx(off["losses"][0], rel=1e-3)


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_the_weight_scales_are_ready_for_fsdp2s_copy_in_stream_with_a_post_optimizer_event(single_rank, recipe):
    """The packed weight-amax reduction runs on the default stream in the root forward pre-hook; with
    ``set_post_optim_event`` FSDP2's copy-in stream waits only on that event, which the package records again after
    the reduction (internals/torch_fsdp2.extend_post_optim_event): the same losses, bit for bit, as without it."""
    plain = _train("fp8", recipe)
    with_event = _train("fp8", recipe, post_optim_event=True)
    assert with_event["reductions"] == plain["reductions"] == 4
    assert with_event["losses"] == plain["losses"]
