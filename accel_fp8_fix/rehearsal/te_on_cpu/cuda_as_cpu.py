"""CUDA-as-CPU for Transformer Engine's own Python code (and nothing else).

TE's Python asks for ``device="cuda"``, checks ``tensor.is_cuda`` and queries ``torch.cuda`` for a
device, its capability, streams and events. On a CPU-only torch this layer answers those questions
*for TE's frames only*:

- ``torch.cuda.*`` queries return a Hopper-like answer (sm90, or ``ACCEL_FP8_FIX_CPU_TE_ARCH``) when the
  caller is a ``transformer_engine`` module, and the stock answer for everyone else — so accelerate,
  torch and user code still see "no CUDA" and keep choosing CPU / gloo;
- ``torch.version.cuda`` reads ``CUDA_VERSION`` (13.0, matching the cuBLASLt version ``tex`` reports) for TE's
  frames — TE's FP8 block-scaling check needs CUDA >= 12.9 — and ``None`` (a CPU build) for everyone else;
- a ``TorchFunctionMode`` maps ``device="cuda"`` / ``cuda:N`` / an int device to ``cpu`` in factory
  functions, ``Tensor.to`` and ``Tensor.cuda`` (nobody else asks for CUDA on a CPU machine), and makes
  ``tensor.is_cuda`` answer True to TE's frames.

Nothing here runs a kernel; ``te_on_cpu.tex`` supplies the kernels.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import types

import torch
import torch.autograd.graph
from torch.overrides import TorchFunctionMode

ENV_ARCH = "ACCEL_FP8_FIX_CPU_TE_ARCH"  # "sm90" (Hopper, default) or "sm100" (Blackwell: MXFP8, non-TN GEMMs)
_ARCHES = {"sm89": (8, 9), "sm90": (9, 0), "sm100": (10, 0)}

_state: dict = {"installed": False, "mode": None, "saved": {}}
CUDA_VERSION = "13.0"  # what TE's frames read as torch.version.cuda (tex.get_cublasLt_version() is 130000)


def capability() -> tuple[int, int]:
    arch = os.environ.get(ENV_ARCH, "sm90").strip().lower() or "sm90"
    if arch not in _ARCHES:
        raise ValueError(f"{ENV_ARCH}={arch!r}: expected one of {sorted(_ARCHES)}")
    return _ARCHES[arch]


def _from_te(depth: int = 2) -> bool:
    """Is the frame ``depth`` levels up (the caller of the patched function) Transformer Engine code?"""
    try:
        frame = sys._getframe(depth)
    except ValueError:  # pragma: no cover - shallow stack
        return False
    name = frame.f_globals.get("__name__", "") or ""
    return name.startswith("transformer_engine") and not name.startswith("transformer_engine_torch")


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":", 1)[0] == "cuda"
    return isinstance(device, int) and not isinstance(device, bool)


_CPU = torch.device("cpu")


class _Props(types.SimpleNamespace):
    pass


class _Stream:
    """A CUDA stream stand-in: everything runs synchronously on the CPU."""

    def __init__(self, device=None, priority=0, **_):
        self.device = _CPU
        self.priority = priority
        self.cuda_stream = 0

    def wait_stream(self, _other):
        return None

    def wait_event(self, _event):
        return None

    def record_event(self, event=None):
        return event if event is not None else _Event()

    def synchronize(self):
        return None

    def query(self):
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __eq__(self, other):
        return isinstance(other, _Stream)

    def __hash__(self):
        return 0


class _Event:
    def __init__(self, enable_timing=False, blocking=False, interprocess=False):
        pass

    def record(self, stream=None):
        return None

    def wait(self, stream=None):
        return None

    def synchronize(self):
        return None

    def query(self):
        return True

    def elapsed_time(self, _other):
        return 0.0


_DEFAULT_STREAM = _Stream()


def _te_answers() -> dict:
    major, minor = capability()
    props = _Props(
        name=f"CPU (Transformer Engine rehearsal, sm{major}{minor})",
        major=major,
        minor=minor,
        multi_processor_count=132,
        total_memory=80 * 2**30,
        L2_cache_size=50 * 2**20,
    )
    return {
        "is_available": lambda: True,
        "is_initialized": lambda: True,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "set_device": lambda _d: None,
        "get_device_capability": lambda device=None: (major, minor),
        "get_device_properties": lambda device=None: props,
        "get_device_name": lambda device=None: props.name,
        "synchronize": lambda device=None: None,
        "current_stream": lambda device=None: _DEFAULT_STREAM,
        "default_stream": lambda device=None: _DEFAULT_STREAM,
        "is_current_stream_capturing": lambda: False,
        "empty_cache": lambda: None,
        "is_bf16_supported": lambda including_emulation=True: True,
        "get_rng_state": lambda device="cuda": torch.get_rng_state(),
        "set_rng_state": lambda state, device="cuda": None,
        "manual_seed": lambda seed: None,
        "memory_allocated": lambda device=None: 0,
        "max_memory_allocated": lambda device=None: 0,
        "_lazy_init": lambda: None,
        "device": lambda device=None: contextlib.nullcontext(),
        "_lazy_call": lambda callable, **kwargs: callable(),
    }


def _scoped(name: str, te_answer):
    """``torch.cuda.<name>``: TE's frames get ``te_answer``, every other caller the original."""
    original = getattr(torch.cuda, name, None)

    def scoped(*args, **kwargs):
        if _from_te():
            return te_answer(*args, **kwargs)
        if original is None:
            raise AttributeError(f"module 'torch.cuda' has no attribute {name!r}")
        return original(*args, **kwargs)

    scoped.__name__ = name
    scoped.__qualname__ = f"cuda_as_cpu.{name}"
    scoped.__wrapped__ = original
    return original, scoped


def _autocast_scoped(name: str):
    """``torch.<name>`` for TE's frames: questions about CUDA autocast are answered for CPU autocast
    (accelerate autocasts on the device it runs on, which here is the CPU)."""
    original = getattr(torch, name)

    def scoped(*args, **kwargs):
        if _from_te():
            device = args[0] if args else kwargs.get("device_type", "cuda")
            if name == "get_autocast_gpu_dtype" or device == "cuda":
                return original("cpu") if name != "get_autocast_gpu_dtype" else torch.get_autocast_dtype("cpu")
        return original(*args, **kwargs)

    scoped.__name__ = name
    scoped.__wrapped__ = original
    return original, scoped


class _VersionModule(types.ModuleType):
    """``torch.version`` with ``cuda`` answered per caller: ``CUDA_VERSION`` to TE's frames, the stock value to
    everyone else (a data descriptor on the module's class wins over the module's own ``cuda`` entry)."""

    @property
    def cuda(self):
        return CUDA_VERSION if _from_te() else vars(self).get("cuda")


@contextlib.contextmanager
def _stream_ctx(stream=None):
    yield stream


_IS_CUDA = torch.Tensor.is_cuda  # the descriptor; its __get__ is what the mode sees
_TENSOR_TO = torch.Tensor.to
_TENSOR_CUDA = torch.Tensor.cuda


class CudaAsCpuMode(TorchFunctionMode):
    """Maps CUDA devices to CPU in torch calls; ``is_cuda`` is True for TE's frames."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__self__", None) is _IS_CUDA:
            if _from_te(2):
                return True
            return func(*args, **kwargs)
        if func is _TENSOR_CUDA:
            return args[0]
        device = kwargs.get("device")
        if device is not None and _is_cuda_device(device):
            kwargs = dict(kwargs, device=_CPU)
        if func is _TENSOR_TO and len(args) > 1 and (_is_cuda_device(args[1])):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


_backward_depth = threading.local()


def in_backward() -> bool:
    """True while the autograd engine runs a backward started in this thread."""
    return getattr(_backward_depth, "n", 0) > 0


def _mode_active(mode) -> bool:
    from torch.overrides import _get_current_function_mode_stack

    return any(m is mode for m in _get_current_function_mode_stack())


def _backward_with_mode(original, mode):
    """``Tensor.backward`` / ``autograd.grad`` are torch functions: the mode is off while they run, so
    TE's backward would miss it. Re-enter the mode around the engine call (plain Python, no dispatch)."""

    def _engine_run_backward(*args, **kwargs):
        _backward_depth.n = getattr(_backward_depth, "n", 0) + 1
        try:
            if _mode_active(mode):
                return original(*args, **kwargs)
            with mode:
                return original(*args, **kwargs)
        finally:
            _backward_depth.n -= 1

    _engine_run_backward.__wrapped__ = original
    return _engine_run_backward


def install() -> None:
    """Idempotent. Patches ``torch.cuda`` queries (scoped to TE callers) and enters the mode."""
    if _state["installed"]:
        return
    saved = {}
    for name, answer in _te_answers().items():
        original, scoped = _scoped(name, answer)
        saved[name] = original
        setattr(torch.cuda, name, scoped)
    # Stream / Event classes and the stream context: TE only ever uses them to order work. The "CUDA"
    # generator is the CPU one: the CUDA ops of TE's frames run on the CPU (dropout draws from it).
    for name, value in (("Stream", _Stream), ("Event", _Event), ("stream", _stream_ctx),
                        ("default_generators", (torch.default_generator,))):
        saved[name] = getattr(torch.cuda, name, None)
        setattr(torch.cuda, name, value)
    # NVTX ranges (older TE opens one per forward): no profiler here, so no-ops for TE's frames.
    import torch.cuda.nvtx as nvtx

    for name, answer in (("range", lambda *a, **k: contextlib.nullcontext()), ("range_push", lambda *a, **k: 0),
                         ("range_pop", lambda *a, **k: 0), ("mark", lambda *a, **k: None)):
        original = getattr(nvtx, name)

        def scoped(*args, _original=original, _answer=answer, **kwargs):
            return _answer(*args, **kwargs) if _from_te() else _original(*args, **kwargs)

        saved["nvtx." + name] = original
        setattr(nvtx, name, scoped)
    for name in ("is_autocast_enabled", "get_autocast_dtype", "get_autocast_gpu_dtype"):
        if hasattr(torch, name):
            original, scoped = _autocast_scoped(name)
            saved["torch." + name] = original
            setattr(torch, name, scoped)
    if type(torch.version) is types.ModuleType:
        torch.version.__class__ = _VersionModule
    mode = CudaAsCpuMode()

    original = torch.autograd.graph._engine_run_backward
    wrapped = _backward_with_mode(original, mode)
    torch.autograd.graph._engine_run_backward = wrapped
    torch.autograd._engine_run_backward = wrapped
    _state["engine"] = original
    mode.__enter__()
    _state.update(installed=True, mode=mode, saved=saved)


def uninstall() -> None:
    if not _state["installed"]:
        return
    for name, original in _state["saved"].items():
        if name.startswith("torch."):
            setattr(torch, name[len("torch."):], original)
        elif name.startswith("nvtx."):
            setattr(torch.cuda.nvtx, name[len("nvtx."):], original)
        elif original is None:
            delattr(torch.cuda, name)
        else:
            setattr(torch.cuda, name, original)
    _state["mode"].__exit__(None, None, None)
    if type(torch.version) is _VersionModule:
        torch.version.__class__ = types.ModuleType
    torch.autograd.graph._engine_run_backward = _state["engine"]
    torch.autograd._engine_run_backward = _state["engine"]
    _state.update(installed=False, mode=None, saved={})
