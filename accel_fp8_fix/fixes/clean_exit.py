"""A finished run exits 0: the process group accelerate created is destroyed before interpreter teardown.

Stock accelerate creates the default process group in ``PartialState.__init__`` (accelerate/state.py:244 and
:285 in 1.15, ``torch.distributed.init_process_group``) and destroys it only in ``Accelerator.end_training()``
(accelerator.py:3448 → ``PartialState.destroy_process_group``, state.py:847); there is no ``atexit``. A script
that does not call ``end_training()`` (most do not: it reads as "stop the trackers") leaves the gloo process
group alive into interpreter teardown. Its C++ worker threads (``pt_gloo_runloop``, ProcessGroupGloo) then
race ``Py_FinalizeEx``: dropping a tensor that has a Python object takes the GIL (torch 2.13 ``intrusive_ptr``
decrefs the PyObject when the C++ count goes 2 → 1, ``c10/util/intrusive_ptr.h`` ``reset_not_null_``), and a
thread that takes the GIL while the interpreter finalizes is ended by ``pthread_exit``, whose forced unwind
meets a ``noexcept`` frame: ``terminate called without an active exception``, SIGABRT, exit status 1 for a
run that finished (torch's own attempt at the same remedy: pytorch/pytorch#179291, abandoned; #190489).
Calling ``torch.distributed.destroy_process_group()`` at the end of the script removes it — what plain torch
scripts do.

The fix: when accelerate (its ``PartialState``) creates the default process group while this patch set is
applied, an ``atexit`` handler is registered that destroys it (every group, as ``end_training`` would) after the
user's script is done and before the interpreter tears down. It does nothing when the group is already
destroyed (``end_training()`` or the script did it), when the patch set has been undone since
(``accel_fp8_fix.deactivate()``: stock behaviour), for fork-launched processes (accelerate skips them too), and
when the script ends on an unhandled exception (peers may be gone or stuck inside a collective: destroying
could block; the run fails anyway). It is bounded: the destroy runs on a helper thread, waited for
``ACCEL_FP8_FIX_EXIT_TIMEOUT`` seconds (default 60); past that it is left to teardown with a warning.

``destroy_process_group()`` alone is not enough when the group is still referenced (FSDP2's state, a DeviceMesh:
the usual case after ``prepare``): the C++ group, and its worker threads, outlive it, and a worker may still be
releasing the tensors of the last collective. The handler therefore also holds the interpreter, GIL released,
for ``ACCEL_FP8_FIX_EXIT_GRACE`` seconds (default 0.2) so that such a release completes before finalization.
Measured (one process, gloo group made by ``PartialState``, still referenced, 20 waited all-reduces, exit): stock
2 of 40 aborted; ``destroy_process_group()`` alone 1 of 40; this handler 0 of 40.
"""

from __future__ import annotations

import atexit
import logging
import sys
import threading
import time

from ..engine.engine import calling_patch_set, is_applied

logger = logging.getLogger("accel_fp8_fix")

TIMEOUT_ENV = "ACCEL_FP8_FIX_EXIT_TIMEOUT"
DEFAULT_TIMEOUT_S = 60.0
GRACE_ENV = "ACCEL_FP8_FIX_EXIT_GRACE"
DEFAULT_GRACE_S = 0.2

_lock = threading.Lock()
_registered = False
_patch_set: str | None = None  # the set whose PartialState.__init__ fix registered the handler


def partial_state_init(wrapped, instance, args, kwargs):
    """``PartialState.__init__``: stock, then, if this call created the default process group, arrange its
    destruction at exit (once per process)."""
    global _patch_set
    dist = _dist()
    before = dist is not None and dist.is_initialized()
    result = wrapped(*args, **kwargs)
    if dist is not None and not before and dist.is_initialized():
        _patch_set = calling_patch_set()
        _register()
    return result


def _dist():
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    return dist if dist.is_available() else None


def _register() -> None:
    global _registered
    with _lock:
        if not _registered:
            atexit.register(destroy_at_exit)
            _registered = True


def _fix_applied() -> bool:
    """The patch set that registered the handler is still applied (not undone since)."""
    return is_applied(_patch_set)


def _seconds(name: str, default: float) -> float:
    """A registered seconds setting (checked at ``Accelerator()``; see accel_fp8_fix/settings.py)."""
    from .. import settings

    value = settings.get(name)
    return default if value is None else max(float(value), 0.0)


def _timeout() -> float:
    return _seconds(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)


def _failing_exit() -> bool:
    """The interpreter is exiting on an unhandled exception (printed, and kept in sys.last_value)."""
    return getattr(sys, "last_value", None) is not None or getattr(sys, "last_exc", None) is not None


def destroy_at_exit() -> str:
    """The atexit handler; returns what it did (for tests): destroyed | skipped: <why> | timed out."""
    dist = _dist()
    if dist is None or not dist.is_initialized():
        return "skipped: no process group"
    if not _fix_applied():
        return "skipped: patch set not applied"
    if _fork_launched():
        return "skipped: fork-launched"
    if _failing_exit():
        return "skipped: unhandled exception"
    errors: list[BaseException] = []

    def destroy():
        try:
            dist.destroy_process_group()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    try:
        worker = threading.Thread(target=destroy, name="accel_fp8_fix-destroy-process-group", daemon=True)
        worker.start()
    except RuntimeError:  # Python >= 3.12 refuses new threads once finalization began: destroy inline
        destroy()
    else:
        worker.join(_timeout())  # the GIL is released while waiting: workers finishing a collective can decref
        if worker.is_alive():
            logger.warning(
                "accel_fp8_fix: destroying the process group at exit did not finish within %ss (%s); "
                "left to interpreter teardown", _timeout(), TIMEOUT_ENV)
            return "timed out"
    # destroy_process_group() joins gloo's worker threads only if it drops the last reference to the group; FSDP2's
    # state and DeviceMesh objects usually still hold it, so a worker may still be releasing the tensors of the
    # last collective (it needs the GIL for that). Give it the GIL, without the interpreter finalizing, first.
    time.sleep(_grace())
    if errors:
        logger.debug("accel_fp8_fix: destroy_process_group at exit failed: %r", errors[0])
        return f"skipped: {type(errors[0]).__name__}"
    return "destroyed"


def _grace() -> float:
    return _seconds(GRACE_ENV, DEFAULT_GRACE_S)


def _fork_launched() -> bool:
    state = sys.modules.get("accelerate.state")
    if state is None:
        return False
    try:
        return bool(state.PartialState._shared_state.get("fork_launched", False))
    except Exception:  # noqa: BLE001
        return False
