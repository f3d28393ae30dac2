"""The rehearsal's ``CudaAsCpuMode`` under torch.compile (one process, dynamo's ``eager`` backend).

torch 2.13's dynamo compiles a ``TorchFunctionMode``'s ``__torch_function__`` as a frame of its own when it is
called from a frame dynamo fell back to eager for, and installs no guard on a method-wrapper argument
(torch/_dynamo/variables/builder.py, the ``types.MethodWrapperType`` branch): the code compiled for
``func = Tensor.shape.__get__`` is then reused for ``Tensor.device.__get__``, and ``tensor.device`` answers a
``torch.Size``. In a compiled FP8 run of transformers' Qwen2 that was ``arange() ... got (int, device=torch.Size)``.
``cuda_as_cpu._skip_dynamo_frames`` keeps the rehearsal's functions out of dynamo's frame compilation."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional


@torch._dynamo.disable
def _eager_part(x):
    return x


def _model_like(ids, w):
    for _ in range(2):  # a graph break in a loop: dynamo falls back to eager for this frame (its callback stays on)
        ids = _eager_part(ids)
    e = F.embedding(ids, w)  # the mode's __torch_function__ compiled for embedding (two tensors) ...
    return torch.arange(e.shape[1], device=e.device)  # ... recompiled for Tensor.shape, reused for Tensor.device


def _run_under(mode_cls):
    torch._dynamo.reset()
    try:
        with mode_cls():
            return torch.compile(_model_like, backend="eager")(torch.randint(0, 8, (2, 5)), torch.randn(8, 4))
    finally:
        torch._dynamo.reset()


def test_compiled_code_under_the_rehearsal_mode_gets_the_right_tensor_device():
    from accel_fp8_fix.rehearsal.te_on_cpu import cuda_as_cpu

    assert cuda_as_cpu._skip_dynamo_frames() > 10  # the mode, its helpers, the scoped torch.cuda answers
    out = _run_under(cuda_as_cpu.CudaAsCpuMode)
    assert torch.equal(out, torch.arange(5))


def test_the_mode_is_still_inlined_where_dynamo_traces():
    """Skipping is per frame only: a compiled function that runs under the mode still becomes one graph."""
    from accel_fp8_fix.rehearsal.te_on_cpu import cuda_as_cpu

    cuda_as_cpu._skip_dynamo_frames()
    torch._dynamo.reset()
    try:
        with cuda_as_cpu.CudaAsCpuMode():
            fn = torch.compile(lambda x: x + torch.arange(x.shape[1], device=x.device), backend="eager", fullgraph=True)
            assert torch.equal(fn(torch.ones(2, 3)), torch.ones(2, 3) + torch.arange(3))
    finally:
        torch._dynamo.reset()


@pytest.mark.skipif(tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) != (2, 13),
                    reason="documents torch 2.13's dynamo; re-check on another torch")
def test_torch_2_13_dynamo_reuses_a_modes_frame_for_another_property_getter():
    """The canary: a plain pass-through mode (not skipped) still hits the dynamo bug the rehearsal avoids."""
    from torch.overrides import TorchFunctionMode

    class PassThrough(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if kwargs is None:
                kwargs = {}
            return func(*args, **kwargs)

    with pytest.raises(TypeError, match=r"device=torch\.Size"):
        _run_under(PassThrough)


_REPRO_AFTER_START_UP = """
import sys
started_with_dynamo = "torch._dynamo" in sys.modules
import torch
from accel_fp8_fix.rehearsal.te_on_cpu import cuda_as_cpu
F = torch.nn.functional

@torch._dynamo.disable
def eager_part(x):
    return x

def model_like(ids, w):
    for _ in range(2):
        ids = eager_part(ids)
    e = F.embedding(ids, w)
    return torch.arange(e.shape[1], device=e.device)

with cuda_as_cpu.CudaAsCpuMode():
    out = torch.compile(model_like, backend="eager")(torch.randint(0, 8, (2, 5)), torch.randn(8, 4))
print(started_with_dynamo, torch.equal(out, torch.arange(5)))
"""


def test_a_process_that_imports_dynamo_after_the_rehearsal_started_gets_the_frames_skipped_then():
    """The rehearsal installed at start-up (the ``.pth`` hook) does not import dynamo (~1 s: a launcher or a tool's
    helper process never needs it); the frames are skipped when dynamo arrives."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCEL")}
    env.update(ACCEL_FP8_FIX_REHEARSAL="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", _REPRO_AFTER_START_UP], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["False", "True"], proc.stdout + proc.stderr[-3000:]
