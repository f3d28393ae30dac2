"""Guard and helpers of the GPU tests that need REAL Transformer Engine on one CUDA GPU.

Importing this module skips the importing test module, with the reason, where CUDA is unavailable, where
``transformer_engine.pytorch`` is not importable, where it runs on accel_fp8_fix's CPU kernel shim (the
rehearsal), or where TE says the GPU cannot run FP8.
"""

from __future__ import annotations

import os
import socket
import sys
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch")

if not torch.cuda.is_available():
    pytest.skip("real Transformer Engine tests need a CUDA GPU (torch.cuda.is_available() is False)",
                allow_module_level=True)
if os.environ.get("ACCEL_FP8_FIX_REHEARSAL", "").strip().lower() not in ("", "0", "false", "no", "off"):
    pytest.skip("ACCEL_FP8_FIX_REHEARSAL is set: that is the CPU rehearsal, not real Transformer Engine kernels",
                allow_module_level=True)
te = pytest.importorskip("transformer_engine.pytorch", reason="real Transformer Engine is not installed")
if not getattr(sys.modules.get("transformer_engine_torch"), "__name__", "").startswith("transformer_engine"):
    pytest.skip("transformer_engine_torch is accel_fp8_fix's CPU kernel shim, not TE's CUDA extension",
                allow_module_level=True)
_ok, _why = te.is_fp8_available(return_reason=True)
if not _ok:
    pytest.skip(f"this GPU cannot run Transformer Engine FP8: {_why}", allow_module_level=True)


def state_manager():
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    return FP8GlobalStateManager


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    state_manager().reset()


def single_rank_process_group():
    """World size 1 on this GPU (NCCL for CUDA tensors, gloo for CPU ones), the fixes active; a generator
    for a module-scoped fixture."""
    import torch.distributed as dist

    import accel_fp8_fix

    saved = dict(os.environ)
    port = free_port()
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    accel_fp8_fix.activate()
    import accelerate  # noqa: F401  (the patch set is chosen when accelerate is imported)

    assert accel_fp8_fix.active_patch_set() is not None, accel_fp8_fix.report()
    if not dist.is_initialized():
        dist.init_process_group("cuda:nccl,cpu:gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                                timeout=timedelta(seconds=60))
    try:
        yield
    finally:
        reset_accelerate()
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved)


class GemmSpy:
    """Counts TE's GEMMs (``transformer_engine_torch.generic_gemm``, what every TE Linear GEMM calls; with
    ``name="te_general_grouped_gemm"`` the grouped GEMMs of ``GroupedLinear``, one per call) and those whose operands
    are all TE quantized (FP8) tensors, while active."""

    def __init__(self, name: str = "generic_gemm"):
        import transformer_engine_torch as tex

        self._tex, self._name, self._original = tex, name, getattr(tex, name)
        self.calls = self.fp8 = 0

    def __enter__(self):
        def counting(*args, **kwargs):
            self.calls += 1
            operands = [o for arg in args[0:3:2] for o in (arg if isinstance(arg, (list, tuple)) else [arg])]
            if len(args) > 2 and all(type(o).__module__.startswith("transformer_engine.") for o in operands):
                self.fp8 += 1
            return self._original(*args, **kwargs)

        setattr(self._tex, self._name, counting)
        return self

    def __exit__(self, *exc):
        setattr(self._tex, self._name, self._original)
