"""CUDA-as-CPU for Transformer Engine's own Python code (and nothing else).

TE's Python asks for ``device="cuda"``, checks ``tensor.is_cuda`` and queries ``torch.cuda`` for a
device, its capability, streams and events. On a CPU-only torch this layer answers those questions
*for TE's frames only*:

- ``torch.cuda.*`` queries answer as the target GPU machine (``target.py``: ``ACCEL_FP8_FIX_REHEARSAL_TARGET``,
  default the project's H200 — capability, device properties) when the caller is a ``transformer_engine``
  module, and the stock answer for everyone else — so accelerate, torch and user code still see "no CUDA" and
  keep choosing CPU / gloo;
- ``torch.version.cuda`` reads the target's CUDA version (13.0 for the H200 image; TE's FP8 block-scaling check
  needs >= 12.9) for TE's frames, and ``None`` (a CPU build) for everyone else;
- ``torch.cuda.Stream`` / ``Event`` / ``stream`` / ``default_generators`` are properties of ``torch.cuda``'s
  (swapped) class: synchronous stand-ins and the CPU generator for TE's frames, the stock objects for everyone
  else; TE's ``torch.cuda.get_rng_state`` / ``set_rng_state`` / ``manual_seed`` act on the CPU generator (the
  rehearsal's "CUDA generator");
- a ``TorchFunctionMode`` (entered globally) maps ``device="cuda"`` / ``cuda:N`` / an int device to ``cpu`` in
  factory functions and ``Tensor.to``, makes ``Tensor.cuda`` a move to the CPU, and answers ``tensor.is_cuda``
  as a GPU would in this world (True on the CPU, False on meta) — when the torch call comes from TE or the
  kernel shim (the first frame up the stack that is not torch's own Python). Every other call passes through:
  accelerate, this package and user scripts meet an honest CPU-only torch, so a planted ``.cuda()`` fails as it
  would on a CPU machine. The kernel shim's kernels run with the mode popped (``mode_off``, applied by ``tex``):
  they compute on CPU tensors, and they make ~70 % of a rehearsal FP8 step's torch calls — through the mode each
  would cost a Python call (a tiny Llama's FP8 step 25 -> 19.5 ms without them).

Nothing here runs a kernel; ``te_on_cpu.tex`` supplies the kernels.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import types

import torch
import torch.autograd.graph
from torch._C import (_get_function_stack_at, _len_torch_function_stack, _pop_torch_function_stack,
                       _push_on_torch_function_stack)
from torch.overrides import TorchFunctionMode

from . import target as _target  # the GPU machine answered as: ACCEL_FP8_FIX_REHEARSAL_TARGET (+ _CPU_TE_ARCH)

ENV_ARCH = _target.ENV_ARCH  # overrides only the capability of the target profile (target.py)
_ARCHES = _target.ARCHES

_state: dict = {"installed": False, "mode": None, "saved": {}}


def capability() -> tuple[int, int]:
    return _target.capability()


def __getattr__(name: str):
    if name == "CUDA_VERSION":  # what TE's frames read as torch.version.cuda: the target profile's
        return _target.cuda_version()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# the kernel shim: tex (installed as sys.modules["transformer_engine_torch"]) and the modules it is assembled from
_SHIM = __name__.rsplit(".", 1)[0] + ".kernels"
_SHIM_MODULES = frozenset(__name__.rsplit(".", 1)[0] + f".{part}" for part in ("tex", "kernels", "grouped"))


def _is_te_module(name: str) -> bool:
    """Transformer Engine's Python or the kernel shim that stands in for its CUDA extension."""
    return (name.startswith("transformer_engine") and not name.startswith("transformer_engine_torch")) or (
        name in _SHIM_MODULES)


def _from_te(depth: int = 2) -> bool:
    """Is the frame ``depth`` levels up (the caller of the patched function) Transformer Engine code?"""
    try:
        frame = sys._getframe(depth)
    except ValueError:  # pragma: no cover - shallow stack
        return False
    return _is_te_module(frame.f_globals.get("__name__", "") or "")


# module name -> True (TE / the shim), False (anyone else), None (plumbing: torch's own Python, contextlib,
# functools, this module: the question is asked on behalf of the code further up). Bounded by the module count.
_CALLER_KIND: dict = {}


def _caller_kind(name: str):
    kind = _CALLER_KIND.get(name, ...)
    if kind is ...:
        if name == "torch" or name.startswith("torch.") or name in ("contextlib", "functools", __name__):
            kind = None
        else:
            kind = _is_te_module(name)
        _CALLER_KIND[name] = kind
    return kind


def _caller_is_te(frame) -> bool:
    """Is the code that made this torch call Transformer Engine? The first frame up from ``frame`` that is not
    torch's own Python (``torch.nn.functional``, ``torch.distributed``, ``nn.Module._apply`` ...) decides."""
    while frame is not None:
        kind = _caller_kind(frame.f_globals.get("__name__") or "")
        if kind is not None:
            return kind
        frame = frame.f_back
    return False


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


def _seed_cpu_generator(seed) -> None:
    torch.default_generator.manual_seed(int(seed))


def _props(device=None) -> _Props:
    """``get_device_properties`` of the target profile (read per query, as every profile answer is)."""
    p = _target.profile()
    major, minor = p.capability
    return _Props(
        name=f"{p.gpu} (CPU rehearsal, sm{major}{minor})",
        major=major,
        minor=minor,
        multi_processor_count=p.sm_count,
        total_memory=p.total_memory,
        L2_cache_size=p.l2_cache,
    )


def _te_answers() -> dict:
    return {
        "is_available": lambda: True,
        "is_initialized": lambda: True,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "set_device": lambda _d: None,
        "get_device_capability": lambda device=None: _target.capability(),
        "get_device_properties": _props,
        "get_device_name": lambda device=None: _props().name,
        "synchronize": lambda device=None: None,
        "current_stream": lambda device=None: _DEFAULT_STREAM,
        "default_stream": lambda device=None: _DEFAULT_STREAM,
        "is_current_stream_capturing": lambda: False,
        "empty_cache": lambda: None,
        "is_bf16_supported": lambda including_emulation=True: True,
        "get_rng_state": lambda device="cuda": torch.get_rng_state(),
        # the rehearsal's "CUDA generator" is the CPU generator (default_generators below): TE's saves and
        # restores of the CUDA RNG state act on it, as they would on the GPU's
        "set_rng_state": lambda state, device="cuda": torch.set_rng_state(state),
        "manual_seed": _seed_cpu_generator,
        "manual_seed_all": _seed_cpu_generator,
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
        return _target.cuda_version() if _from_te() else vars(self).get("cuda")


@contextlib.contextmanager
def _stream_ctx(stream=None):
    yield stream


def _per_caller(name: str, te_value) -> property:
    """A ``torch.cuda`` attribute answered per caller: ``te_value`` to TE's frames (and the shim's), the module's
    own entry (the stock one) to everyone else. Setting / deleting it acts on the module's own entry."""

    def fget(module):
        if _from_te():
            return te_value
        try:
            return vars(module)[name]
        except KeyError:
            raise AttributeError(f"module {module.__name__!r} has no attribute {name!r}") from None

    def fset(module, value):
        vars(module)[name] = value

    def fdel(module):
        del vars(module)[name]

    return property(fget, fset, fdel, doc=f"torch.cuda.{name}, answered per caller (cuda_as_cpu)")


# torch.cuda's classes and values (not functions, so not wrapped like the queries): stream and event stand-ins
# (everything runs synchronously on the CPU), and the "CUDA" generator, which is the CPU one (the CUDA ops of
# TE's frames run on the CPU; dropout draws from it).
_CUDA_ATTRS = {"Stream": _Stream, "Event": _Event, "stream": _stream_ctx,
               "default_generators": (torch.default_generator,)}


def _cuda_module_class(base: type) -> type:
    """A subclass of ``torch.cuda``'s module class whose properties answer ``_CUDA_ATTRS`` per caller (a data
    descriptor on the class wins over the module's own entry, as for ``torch.version.cuda``)."""
    namespace = {name: _per_caller(name, value) for name, value in _CUDA_ATTRS.items()}
    namespace["__doc__"] = base.__doc__
    return type("_CudaAsCpuModule", (base,), namespace)


_IS_CUDA = torch.Tensor.is_cuda  # the descriptor; its __get__ is what the mode sees
_TENSOR_TO = torch.Tensor.to
_TENSOR_CUDA = torch.Tensor.cuda
_EMPTY_LIKE = torch.empty_like
# nn.Module's device moves: they reach each tensor through ``_apply``, which TE's modules override (to re-attach
# state), so TE's frames sit between the caller of ``model.cuda()`` and the tensor's ``.cuda()``.
_MODULE_MOVES = frozenset(f.__code__ for f in (torch.nn.Module.cuda, torch.nn.Module.to, torch.nn.Module.to_empty))


def _move_is_te(frame) -> bool:
    """``.cuda()`` / ``.to(cuda)`` / ``empty_like(device=cuda)``: as ``_caller_is_te``, except that inside a
    module move (``nn.Module.cuda`` / ``.to`` / ``.to_empty``) whoever called the move decides — a user's
    ``te_model.cuda()`` is the user's request even though TE's ``_apply`` makes the tensor calls."""
    if not _caller_is_te(frame):
        return False
    while frame is not None:
        if frame.f_code in _MODULE_MOVES:
            return _caller_is_te(frame.f_back)
        frame = frame.f_back
    return True


class CudaAsCpuMode(TorchFunctionMode):
    """For TE's frames (and the kernel shim's) only: CUDA devices map to the CPU in torch calls, ``.cuda()`` is
    ``.to("cpu")``, ``is_cuda`` is True for tensors on the CPU (the rehearsal's "GPU"), False elsewhere (meta).
    Every other caller's call passes through untouched: a CPU-only torch answers it (and refuses CUDA).

    The mode sees every torch call made while it is active; the frame walk runs only for a call that asks
    about CUDA (``is_cuda``, ``.cuda()``, a CUDA ``device``), so the common case is a few identity checks."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if func is _TENSOR_CUDA:
            if _move_is_te(sys._getframe(1)):
                tensor = args[0]
                return tensor if tensor.device.type == "cpu" else tensor.to(_CPU)
        elif getattr(func, "__self__", None) is _IS_CUDA:
            if _caller_is_te(sys._getframe(1)):
                return args[0].device.type == "cpu"
        else:
            device = kwargs.get("device")
            if device is not None:
                if _is_cuda_device(device) and (
                        _move_is_te(sys._getframe(1)) if func is _TENSOR_TO or func is _EMPTY_LIKE
                        else _caller_is_te(sys._getframe(1))):
                    kwargs = dict(kwargs, device=_CPU)
            elif func is _TENSOR_TO and len(args) > 1 and _is_cuda_device(args[1]) and _move_is_te(sys._getframe(1)):
                args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


def _stack_top():
    depth = _len_torch_function_stack()
    return _get_function_stack_at(depth - 1) if depth else None


def mode_off(kernel):
    """``kernel`` (a function of the kernel shim) runs with the mode popped: its torch calls are the CPU arithmetic
    of TE's kernels on CPU tensors, and through the mode each would cost a Python call (the shim makes most of a
    rehearsal step's torch calls). Anything in it that still asks for CUDA fails as on a CPU machine."""

    @functools.wraps(kernel)
    def run(*args, **kwargs):
        mode = _state["mode"]
        if mode is None or _stack_top() is not mode:
            return kernel(*args, **kwargs)
        _pop_torch_function_stack()
        try:
            return kernel(*args, **kwargs)
        finally:
            _push_on_torch_function_stack(mode)

    return run


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


def _codes(obj, seen: set):
    """The code objects of a function / class defined here, and those nested in them (closures such as
    ``_scoped``'s ``scoped``, ``_per_caller``'s ``fget``)."""
    if isinstance(obj, type):
        for value in vars(obj).values():
            parts = (value.fget, value.fset, value.fdel) if isinstance(value, property) else (value,)
            for part in parts:
                yield from _codes(getattr(part, "__func__", part), seen)
        return
    code = getattr(obj, "__code__", None)
    stack = [code] if isinstance(code, types.CodeType) else []
    while stack:
        code = stack.pop()
        if code in seen:
            continue
        seen.add(code)
        yield code
        stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))


def _skip_dynamo_frames() -> int:
    """Keep torch.compile from compiling this module's functions as frames of their own, as it never does for
    torch's own Python (dynamo's skip list). Called from eager code inside a compiled region — a frame dynamo
    fell back to — the mode's ``__torch_function__`` was compiled per call and its cached code reused for
    another ``func``: dynamo installs no guard on a method-wrapper argument (torch/_dynamo/variables/builder.py,
    the ``types.MethodWrapperType`` branch), so the code compiled for ``Tensor.shape.__get__`` answered
    ``tensor.device`` with a ``torch.Size``. Only the frame-level decision changes: dynamo still inlines the mode
    when it traces a frame that runs under it. Returns how many code objects were marked."""
    try:
        from torch._dynamo.eval_frame import skip_code
    except ImportError:  # pragma: no cover - a torch without dynamo
        return 0
    seen: set = set()
    for value in list(globals().values()):
        if getattr(value, "__module__", None) == __name__ and (isinstance(value, type) or callable(value)):
            for code in _codes(value, seen):
                skip_code(code)
    return len(seen)


def install() -> None:
    """Idempotent. Patches ``torch.cuda`` queries (scoped to TE callers) and enters the mode."""
    if _state["installed"]:
        return
    if "torch._dynamo" in sys.modules:
        _skip_dynamo_frames()
    else:  # when dynamo arrives (TE imports it): a process that never imports it (a tool's helper, a launcher)
        import wrapt  # should not pay its ~1 s import for the rehearsal

        wrapt.register_post_import_hook(lambda _dynamo: _skip_dynamo_frames(), "torch._dynamo")
    saved = {}
    for name, answer in _te_answers().items():
        original, scoped = _scoped(name, answer)
        saved[name] = original
        setattr(torch.cuda, name, scoped)
    # Stream / Event classes and the stream context (TE only ever uses them to order work), the "CUDA"
    # generator: per caller, through torch.cuda's class.
    _state["cuda_class"] = type(torch.cuda)
    torch.cuda.__class__ = _cuda_module_class(type(torch.cuda))
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
    torch.cuda.__class__ = _state.pop("cuda_class")
    if type(torch.version) is _VersionModule:
        torch.version.__class__ = types.ModuleType
    torch.autograd.graph._engine_run_backward = _state["engine"]
    torch.autograd._engine_run_backward = _state["engine"]
    _state.update(installed=False, mode=None, saved={})
