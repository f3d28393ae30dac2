"""Errors explained where they happen: a note on the original exception, never another exception.

The DTensor errors this package exists for reach users as bare PyTorch messages from deep inside DTensor
dispatch. While the fixes are active, an error of a known kind escaping ``prepare``, a forward, ``backward``,
``clip_grad_norm_``, the optimizer's ``step``, ``save_state`` or ``load_state`` gets a note: which module or
parameter (found by auditing the model and the frames of the traceback), the likely cause and the fix.

How the exception is left:

* the same object is re-raised with a bare ``raise`` (same type, same args apart from the note on 3.10,
  same ``__traceback__``, ``__cause__`` and ``__context__``): only the frame of the wrapper that re-raises is
  added to the traceback, as with any wrapper; forward errors are annotated from a forward hook with
  ``always_call=True`` (torch calls it inside its own ``except`` and re-raises itself: no frame added);
* Python >= 3.11: ``BaseException.add_note``. Python 3.10 has no notes: the note is kept in ``__notes__``
  (what 3.11 uses; ``traceback`` of 3.10 does not print it) and, when the exception has one string argument
  and the stock ``__str__``, appended to that argument so that it is printed; anything else is left as is;
* a note is added once per exception, and building it can never raise (a failure there is logged and the
  original error propagates untouched). Nothing is ever swallowed.

``explain_errors(model)`` gives the same notes around any block, fixes on or off (e.g. stock accelerate).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import sysconfig
from types import TracebackType

from ..distributed.dtensor import is_dtensor

logger = logging.getLogger(__name__)

__all__ = ["add_note", "classify", "explain", "annotate", "explain_errors", "install_forward_notes"]

NOTED = "_accel_fp8_fix_noted"
HAS_ADD_NOTE = hasattr(BaseException, "add_note")

# kind -> the message fragments that identify it (torch 2.4 .. 2.14, TE 1.x .. 2.20)
KINDS = {
    "mixed": ("got mixed torch.Tensor and DTensor", "Expected all inputs to be DTensor, but found a mixture"),
    "collective": ("found no DeviceMesh from dtensor args for c10d", "does not have a sharding strategy registered"),  # c10d.op.default / c10d::op (2.10)
    "fp8_shape": ("FP8 execution requires the",),
    "extra_state": ("Refusing to load pickled Transformer Engine extra state",),
}


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)`` on 3.11+; on 3.10 the equivalent described in the module docstring."""
    if HAS_ADD_NOTE:
        exc.add_note(note)
        return
    notes = getattr(exc, "__notes__", None)
    try:
        exc.__notes__ = [*(notes or ()), note]
    except (AttributeError, TypeError):  # pragma: no cover - exceptions without __dict__
        pass
    if len(exc.args) == 1 and isinstance(exc.args[0], str) and type(exc).__str__ is BaseException.__str__:
        exc.args = (f"{exc.args[0]}\n{note}",)


def classify(exc: BaseException) -> str | None:
    text = str(exc)
    for kind, needles in KINDS.items():
        if any(n in text for n in needles):
            return kind
    return None


# ------------------------------------------------------------------------------------------------ frames
def _library_dirs() -> tuple:
    dirs = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in sysconfig.get_paths()}
    dirs.add(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # accel_fp8_fix itself (editable install)
    return tuple(os.path.join(d, "") for d in dirs if d)


def _is_library(filename: str) -> bool:
    if filename.startswith("<"):
        return True
    path = os.path.abspath(filename)
    return path.startswith(_library_dirs()) or f"{os.sep}site-packages{os.sep}" in path


def _frames(tb: TracebackType | None) -> list:
    out = []
    while tb is not None:
        out.append(tb.tb_frame)
        tb = tb.tb_next
    return out  # outermost first


def _where(frame) -> str:
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


_LIBRARIES = tuple(os.sep + name + os.sep for name in ("accelerate", "transformers", "transformer_engine", "fixes"))


def _user_frame_calling_library(frames) -> object | None:
    """The innermost frame of user code, when only torch runs below it (the user's own call failed); None
    when accelerate, transformers, Transformer Engine or this package's fixes ran in between (a library's)."""
    for i in range(len(frames) - 1, -1, -1):
        if not _is_library(frames[i].f_code.co_filename):
            below = [f.f_code.co_filename for f in frames[i + 1:]]
            return None if any(lib in path for path in below for lib in _LIBRARIES) else frames[i]
    return None


def _names(model) -> tuple[dict, dict]:
    if model is None:
        return {}, {}
    modules = {id(m): n for n, m in model.named_modules()}
    tensors = {}
    for mname, module in model.named_modules():
        for pname, p in list(module._parameters.items()) + list(module._buffers.items()):
            if p is not None:
                tensors.setdefault(id(p), f"{mname}.{pname}" if mname else pname)
    return modules, tensors


def _dtensor_in_collective(frames, tensors: dict) -> str | None:
    for frame in reversed(frames):  # innermost first: the c10d function's own argument
        if not frame.f_code.co_filename.endswith(os.path.join("distributed", "distributed_c10d.py")):
            continue
        for key, value in frame.f_locals.items():
            if is_dtensor(value):
                label = tensors.get(id(value))
                return f"parameter {label}" if label else f"DTensor argument {key!r} {tuple(value.shape)} {list(value.placements)}"
    for frame in reversed(frames):  # the user's variable holding a model parameter
        for key, value in frame.f_locals.items():
            if is_dtensor(value) and id(value) in tensors:
                return f"parameter {tensors[id(value)]}"
    return None


def _module_in_frames(frames, modules: dict) -> tuple[str | None, object]:
    """(qualified name, module) of the innermost model module seen in the traceback's locals; in one frame, a
    module holding DTensor parameters of its own first (convert_model's ``module``, not its parent)."""
    import torch

    for frame in reversed(frames):
        found = [v for v in frame.f_locals.values() if isinstance(v, torch.nn.Module) and id(v) in modules]
        if found:
            found.sort(key=lambda m: not any(is_dtensor(p) for p in m._parameters.values()))
            return modules[id(found[0])], found[0]
    return None, None


def _kinds(module) -> str:
    return ", ".join(f"{n}: " + (f"DTensor {list(t.placements)}" if is_dtensor(t) else "plain")
                     for n, t in (*module._parameters.items(), *module._buffers.items()) if t is not None)


def _fixes_active() -> bool:
    from .._api import active_patch_set

    return active_patch_set() is not None


# ------------------------------------------------------------------------------------------------ notes
def explain(exc: BaseException, model=None, where: str | None = None) -> str | None:
    """The note for ``exc`` (None when it is not one of the errors this package explains)."""
    kind = classify(exc)
    if kind is None:
        return None
    frames = _frames(exc.__traceback__)
    modules, tensors = _names(model)
    user = _user_frame_calling_library(frames)
    lines = [f"accel_fp8_fix diagnosis ({where or 'here'}):"]
    if kind == "collective":
        what = _dtensor_in_collective(frames, tensors) or "a DTensor"
        lines.append(f"  what : {what} was handed to a torch.distributed (c10d) collective, which takes plain "
                     "tensors only (DTensor dispatch has no rule for c10d ops).")
        if user is not None:
            lines.append(f"  where: your own code, {_where(user)}")
            lines.append("  fix  : use accel_fp8_fix.distributed collectives with the mesh: broadcast(t) / all_reduce(t) "
                         "act on a DTensor's local tensor along its replicated mesh dims, all_gather(t) returns the "
                         "full tensor; a plain tensor takes (t, mesh, dims). Or call to_local() / full_tensor() first.")
        else:
            lines.append("  fix  : a library issued it; with accel_fp8_fix active (import accel_fp8_fix, or "
                         "fp8_config: {accel_fp8_fix: true}) every collective of the FP8 path names its group and "
                         "moves local tensors; see docs/troubleshooting.md.")
    elif kind == "mixed":
        name, module = _module_in_frames(frames, modules)
        mixed = []
        if model is not None:
            from .audit import audit

            mixed = audit(model).mixed
        if name is not None:
            lines.append(f"  what : module {name or '(root)'} ({type(module).__name__}; {_kinds(module) or 'no tensors'}) "
                         "was running when an operator combined a DTensor with a plain tensor.")
        if mixed:
            detail = [f"{m or '(root)'} [{_kinds(model.get_submodule(m) if m else model)}]" for m in mixed[:5]]
            lines.append("  audit: modules mixing DTensor and plain tensors: " + "; ".join(detail))
        if user is not None:
            lines.append(f"  where: your own code, {_where(user)}")
        if not _fixes_active():
            lines.append("  cause: stock accelerate converts layers to Transformer Engine before sharding and copies "
                         "DTensor weights into plain TE parameters (A1), or a module holds FP8 state / buffers "
                         "outside its sharded parameters.")
            lines.append("  fix  : activate accel_fp8_fix (import accel_fp8_fix before Accelerator(), or "
                         "fp8_config: {accel_fp8_fix: true}): conversion runs after sharding on the sharded "
                         "parameters; run accel_fp8_fix.audit(model) to see every mixed module.")
        else:
            lines.append("  cause: a module's parameters and buffers are not all DTensor (or all plain) when an "
                         "operator combines them: a tensor added after prepare, or state outside parameters/buffers.")
            lines.append("  fix  : make the plain tensor a DTensor on the same mesh (DTensor.from_local(t, mesh, "
                         "placements) with its true placement) or use to_local() on the DTensor inside your code; "
                         "accel_fp8_fix.audit(model) lists mixed modules and stray tensors.")
    elif kind == "fp8_shape":
        name, _ = _module_in_frames(frames, modules)
        lines.append(f"  what : Transformer Engine's FP8 shape rule failed{f' in {name}' if name else ''}: the tokens "
                     "on this rank (batch x sequence) must be a multiple of 8 and the TP-local feature dims of 16.")
        lines.append("  fix  : pad the batch (DataCollator pad_to_multiple_of=8 or 16); a layer whose local weight "
                     "does not fit is kept in high precision by accel_fp8_fix's conversion (see audit(model).kept).")
    elif kind == "extra_state":
        lines.append("  what : Transformer Engine refused to unpickle a module's FP8 _extra_state from a checkpoint.")
        lines.append("  fix  : with accel_fp8_fix active, the TE modules its prepare created load _extra_state with a "
                     "restricted unpickler (tensors, recipes, primitives only); prepare the model with the fixes "
                     "before load_state, or set NVTE's unsafe-pickle variable only for a checkpoint you trust.")
    lines.append("  (explained by accel_fp8_fix; the error above is PyTorch's / Transformer Engine's own, unchanged)")
    return "\n".join(lines)


def annotate(exc: BaseException, model=None, where: str | None = None) -> bool:
    """Add the note for ``exc`` once; True if a note was added. Never raises."""
    try:
        if getattr(exc, NOTED, False):
            return False
        note = explain(exc, model, where)
        if note is None:
            return False
        add_note(exc, note)
        try:
            setattr(exc, NOTED, True)
        except (AttributeError, TypeError):  # pragma: no cover
            pass
        return True
    except Exception:  # noqa: BLE001 - a diagnosis must never replace the user's error
        logger.debug("accel_fp8_fix: could not build an error note", exc_info=True)
        return False


@contextlib.contextmanager
def explain_errors(model=None, where: str = "your code"):
    """Add this package's notes to a known DTensor / TE error escaping the block (fixes on or off)."""
    try:
        yield
    except Exception as exc:
        annotate(exc, model, where)
        raise


# ------------------------------------------------------------------------------------------------ installation
class _ForwardNotes:
    """A forward hook with ``always_call=True`` on the root module: torch calls it inside its own ``except``
    when the forward raised (``sys.exc_info()`` is the error) and then re-raises the error itself."""

    def __call__(self, module, args, output):
        if output is not None:
            return None
        exc = sys.exc_info()[1]
        if exc is not None:
            annotate(exc, module, "forward")
        return None


def install_forward_notes(model) -> None:
    if getattr(model, "_accel_fp8_fix_forward_notes", False):
        return
    model.register_forward_hook(_ForwardNotes(), always_call=True)
    model._accel_fp8_fix_forward_notes = True


def _model_of(accelerator):
    """The accelerator's one prepared model, else None (never raises: it runs while an error propagates)."""
    try:
        from ..internals.accelerate_internals import prepared_models

        models = prepared_models(accelerator)
        return models[0] if len(models) == 1 else None
    except Exception:  # noqa: BLE001
        return None


def _module_argument(args):
    import torch.nn

    models = [a for a in args if isinstance(a, torch.nn.Module)]
    return models[0] if len(models) == 1 else None


def on_error(exc: BaseException, where: str, instance, args) -> None:
    """The ``on_error`` hook of patches/*.toml: the engine calls it when an exception escapes a patched target
    declared with ``notes = "<where>"``, then re-raises the same exception. The model is the one passed
    (``prepare``), else the accelerator's one prepared model, else (the optimizer's ``step``) the model of
    the last accelerator the patched ``prepare`` saw."""
    model = _module_argument(args)
    if model is None:
        model = _model_of(instance) if hasattr(instance, "_models") else _AcceleratorModels.model()
    annotate(exc, model, where)


DIAGNOSED = "_accel_fp8_fix_diagnosed"


class _AcceleratorModels:
    """The model of the last accelerator whose prepare this package patched (optimizer.step has no accelerator)."""

    last = None

    @classmethod
    def model(cls):
        acc = cls.last() if cls.last is not None else None
        return _model_of(acc) if acc is not None else None


def after_prepare(accelerator, args, kwargs, result) -> None:
    """The ``on_return`` hook of ``Accelerator.prepare`` (patches/*.toml): when this call converted a model
    (``accelerator.accel_fp8_fix.model``), remember the setup for audit(model), install forward notes, warn
    when part of the model stays in high precision, and print the audit when ``ACCEL_FP8_FIX_AUDIT=1``."""
    import weakref

    from .audit import remember_setup, warn_partial_coverage

    setup = getattr(accelerator, "accel_fp8_fix", None)
    model = getattr(setup, "model", None)
    if model is None or getattr(setup, DIAGNOSED, False):
        return  # no prepare of this accelerator converted a model, or its setup was seen by an earlier call
    setattr(setup, DIAGNOSED, True)  # the model may not be in `result`: Trainer's optimizer-only prepare (A22)
    _AcceleratorModels.last = weakref.ref(accelerator)
    remember_setup(model, setup)
    install_forward_notes(model)
    if getattr(setup, "fp8_enabled", False):
        warn_partial_coverage(model, accelerator)
    from .._api import env_flag

    if env_flag("ACCEL_FP8_FIX_AUDIT"):
        from .audit import audit

        report = audit(model, accelerator)
        if _first_rank_of(setup):
            print(f"accel_fp8_fix audit: {report}", flush=True)


def _first_rank_of(setup) -> bool:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return True
    ranks = getattr(setup, "amax_group_ranks", None) or (0,)
    return dist.get_rank() == ranks[0]
