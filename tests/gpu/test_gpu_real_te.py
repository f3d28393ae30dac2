"""FSDP2 / TP + FP8 on REAL NVIDIA Transformer Engine (one CUDA GPU, world size 1, in-process NCCL).

Skipped, with the reason, where CUDA is unavailable, where ``transformer_engine`` is not importable, where it
runs on accel_fp8_fix's CPU kernel shim (the rehearsal, ``ACCEL_FP8_FIX_REHEARSAL``), or where the GPU cannot
run FP8 (Transformer Engine says why). See tests/gpu/README.md.

* ``test_fsdp2_prepare_converts_after_sharding_and_trains_in_fp8``: a real ``Accelerator(mixed_precision=
  "fp8", fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, transformer_based_wrap), kwargs_handlers=
  [TERecipeKwargs(...)])`` with the fixes active prepares a small pre-norm MLP stack and trains two steps.
* ``test_tp_conversion_keeps_dtensor_parameters_and_gradients_flow``: torch TP (Colwise / Rowwise) on a
  1-rank "tp" mesh, then ``record_tp_layout`` + ``convert_after_sharding`` directly, forward / backward under
  TE autocast.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch")

if not torch.cuda.is_available():
    pytest.skip("real Transformer Engine tests need a CUDA GPU (torch.cuda.is_available() is False)",
                allow_module_level=True)

if os.environ.get("ACCEL_FP8_FIX_REHEARSAL", "").strip().lower() not in ("", "0", "false", "no", "off"):
    pytest.skip("ACCEL_FP8_FIX_REHEARSAL is set: that is the CPU rehearsal, not real Transformer Engine kernels "
                "(unset it to run these tests)", allow_module_level=True)

transformer_engine = pytest.importorskip(
    "transformer_engine", reason="real Transformer Engine is not installed (pip install transformer-engine[pytorch])"
)
te = pytest.importorskip("transformer_engine.pytorch", reason="transformer_engine.pytorch is not importable")
import sys  # noqa: E402

if not getattr(sys.modules.get("transformer_engine_torch"), "__name__", "").startswith("transformer_engine"):
    pytest.skip("transformer_engine_torch is accel_fp8_fix's CPU kernel shim, not TE's CUDA extension",
                allow_module_level=True)


def _fp8_support() -> tuple[bool, str]:
    fn = getattr(te, "is_fp8_available", None)
    if fn is not None:
        try:
            answer = fn(return_reason=True)
        except TypeError:
            answer = fn()
    else:  # older TE
        from transformer_engine.pytorch.fp8 import check_fp8_support

        answer = check_fp8_support()
    if isinstance(answer, tuple):
        return bool(answer[0]), str(answer[1])
    return bool(answer), ""


def _state_manager():
    """TE's ``FP8GlobalStateManager`` (2.x: ``pytorch.quantization``; older: ``pytorch.fp8``; not top-level)."""
    import importlib

    for name in ("transformer_engine.pytorch.quantization", "transformer_engine.pytorch.fp8"):
        try:
            return importlib.import_module(name).FP8GlobalStateManager
        except (ImportError, AttributeError):
            continue
    raise ImportError("FP8GlobalStateManager not found in transformer_engine.pytorch.quantization / .fp8")


_FP8_OK, _FP8_WHY = _fp8_support()
if not _FP8_OK:
    pytest.skip(f"this GPU cannot run Transformer Engine FP8: {_FP8_WHY}", allow_module_level=True)

from torch import nn  # noqa: E402

from accel_fp8_fix.testing.training import BlockStack  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

DIM, HIDDEN, TOKENS = 128, 256, 32  # every GEMM dim a multiple of 16, tokens a multiple of 16
RECIPE = {"fp8_format": "HYBRID", "amax_history_len": 16, "amax_compute_algo": "max"}


def _stack():
    """Two pre-norm MLP blocks (``Block``: the FSDP2 wrap unit, found by class name) and a head."""
    return BlockStack(DIM, HIDDEN, 2, DIM)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return self.down(nn.functional.gelu(self.up(x)))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reset_accelerate():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture(scope="module")
def single_rank():
    """World size 1 on this GPU: NCCL for CUDA tensors, gloo for CPU ones, initialised in-process; the
    torchrun-style variables accelerate reads (LOCAL_RANK makes it pick its distributed path)."""
    import torch.distributed as dist

    import accel_fp8_fix

    saved = dict(os.environ)
    port = _free_port()
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    accel_fp8_fix.activate()
    import accelerate  # noqa: F401  (the patch set is chosen when accelerate is imported)

    assert accel_fp8_fix.active_patch_set() is not None, (
        "accel_fp8_fix is not active (ACCEL_FP8_FIX=0, or versions outside every patch set?): "
        f"{accel_fp8_fix.report() if hasattr(accel_fp8_fix, 'report') else ''}"
    )
    dist.init_process_group("cuda:nccl,cpu:gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    try:
        yield
    finally:
        _reset_accelerate()
        _state_manager().reset()
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved)


def _te_linears(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, te.Linear)}


def _fp8_meta_populated(module) -> tuple[bool, bool]:
    """(amax history non-zero, scale moved off 1.0) of the forward delayed-scaling state."""
    state = module.fp8_meta["scaling_fwd"]
    amax_nonzero = bool(state.amax_history.float().abs().sum() > 0)
    scale_moved = bool((state.scale.float() != 1.0).any())
    return amax_nonzero, scale_moved


def test_fsdp2_prepare_converts_after_sharding_and_trains_in_fp8(single_rank):
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin, TERecipeKwargs

    _reset_accelerate()
    _state_manager().reset()
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["Block"]
    )
    acc = Accelerator(mixed_precision="fp8", fsdp_plugin=plugin, kwargs_handlers=[TERecipeKwargs(**RECIPE)])
    assert acc.is_fsdp2 and acc.distributed_type.name == "FSDP", acc.distributed_type
    assert acc.device.type == "cuda"

    torch.manual_seed(0)
    model = _stack().to(acc.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)

    setup = acc.accel_fp8_fix
    assert setup.fp8_enabled
    assert setup.conversion.skipped == []
    assert sorted(setup.conversion.converted) == ["blocks.0.fc1", "blocks.0.fc2", "blocks.0.norm", "blocks.1.fc1",
                                                  "blocks.1.fc2", "blocks.1.norm", "head"]
    linears = _te_linears(model)
    assert set(linears) == {"blocks.0.fc1", "blocks.0.fc2", "blocks.1.fc1", "blocks.1.fc2", "head"}
    for name, module in linears.items():
        assert type(module).__module__.startswith("transformer_engine."), (name, type(module).__module__)
    assert all(isinstance(model.blocks[i].norm, te.LayerNorm) for i in range(2))
    assert all(isinstance(p, DTensor) for p in model.parameters()), {
        n: type(p).__name__ for n, p in model.named_parameters()}
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in model.parameters()}
    assert setup.amax_group_ranks == (0,)
    fp8_buffers = [n for n, _ in model.named_buffers() if "_fp8_" in n]
    assert fp8_buffers, sorted(n for n, _ in model.named_buffers())
    assert {r.path[-1] for r in setup.registered_state} >= {"amax_history", "scale"}

    weight_before = model.blocks[0].fc1.weight.to_local().detach().clone()
    x = torch.randn(TOKENS, DIM, device=acc.device, generator=torch.Generator(device=acc.device).manual_seed(1))
    y = torch.randn(TOKENS, DIM, device=acc.device, generator=torch.Generator(device=acc.device).manual_seed(2))
    losses = []
    for _ in range(2):
        loss = nn.functional.mse_loss(model(x).float(), y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    torch.cuda.synchronize()

    assert all(torch.isfinite(torch.tensor(losses))), losses
    for name, module in linears.items():
        assert module.fp8, f"{name}: the last forward did not run in FP8"
        assert module.fp8_meta.get("fp8_group") is setup.amax_group, name
        amax_nonzero, scale_moved = _fp8_meta_populated(module)
        assert amax_nonzero, f"{name}: fp8_meta['scaling_fwd'].amax_history is all zero after training"
        assert scale_moved, f"{name}: fp8_meta['scaling_fwd'].scale never updated"
    assert not torch.equal(model.blocks[0].fc1.weight.to_local().detach(), weight_before), "optimizer did not step"
    _reset_accelerate()
    _state_manager().reset()


def test_tp_conversion_keeps_dtensor_parameters_and_gradients_flow(single_rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import transformer_engine.common.recipe as te_recipe

    from accel_fp8_fix.fixes.convert.fp8_autocast import te_autocast
    from accel_fp8_fix.fixes.convert.te_convert import convert_after_sharding
    from accel_fp8_fix.fixes.convert.tp_layout import record_tp_layout

    _state_manager().reset()
    mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = MLP().cuda()
    parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    params = dict(model.named_parameters())
    assert all(isinstance(p, DTensor) for p in params.values())
    x = torch.randn(TOKENS, DIM, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    with torch.no_grad():
        reference = model(x)
        reference = reference.full_tensor() if isinstance(reference, DTensor) else reference

    assert record_tp_layout(model) == {"up": "column", "down": "row"}
    report = convert_after_sharding(model, te)
    assert report.converted == ["up", "down"] and report.skipped == []
    assert isinstance(model.up, te.Linear) and isinstance(model.down, te.Linear)
    assert type(model.up).__module__.startswith("transformer_engine.")
    for name, param in model.named_parameters():
        assert param is params[name], f"{name}: the TE module did not take over the same Parameter object"
        assert isinstance(param, DTensor) and param.device_mesh.mesh_dim_names == ("tp",)

    recipe = te_recipe.DelayedScaling(fp8_format=te_recipe.Format.HYBRID, amax_history_len=16,
                                      amax_compute_algo="max")
    with te_autocast(te)(True, recipe, mesh.get_group()):
        out = model(x)
    out_full = out.full_tensor() if isinstance(out, DTensor) else out
    assert torch.isfinite(out_full).all()
    # FP8 (E4M3 forward) against the high-precision forward of the same weights: close, not equal.
    rel = float((out_full.detach().float() - reference.float()).norm() / reference.float().norm())
    assert rel < 0.1, rel
    loss = out_full.float().pow(2).mean()
    loss.backward()
    torch.cuda.synchronize()

    assert model.up.fp8 and model.down.fp8, "the forward did not run in FP8"
    for name, param in model.named_parameters():
        assert param.grad is not None, f"{name}: no gradient reached the DTensor parameter"
        grad = param.grad
        assert isinstance(grad, DTensor), (name, type(grad))
        local = grad.to_local()
        assert torch.isfinite(local).all() and local.abs().sum() > 0, name
    for module in (model.up, model.down):
        amax_nonzero, _ = _fp8_meta_populated(module)
        assert amax_nonzero
    _state_manager().reset()
