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
Calling ``torch.distributed.destroy_process_group()`` at the end of the script (or ``end_training()``) does not
remove it once the groups are still referenced — see below.

The fix: when accelerate (its ``PartialState``) creates the default process group while this patch set is
applied, an ``atexit`` handler is registered that destroys it (every group, as ``end_training`` would) after the
user's script is done and before the interpreter tears down. It does nothing when the group is already
destroyed (``end_training()`` or the script did it), when the patch set has been undone since
(``accel_fp8_fix.deactivate()``: stock behaviour), for fork-launched processes (accelerate skips them too), and
when the script ends on an unhandled exception (peers may be gone or stuck inside a collective: destroying
could block; the run fails anyway). It is bounded: the destroy runs on a helper thread, waited for
``ACCEL_FP8_FIX_EXIT_TIMEOUT`` seconds (default 60); past that it is left to teardown with a warning.

``destroy_process_group()`` alone is not enough when the group is still referenced (FSDP2's state, a DeviceMesh:
the usual case after ``prepare``): the C++ group and its worker threads outlive it, and a worker may still be
running the last collective, or releasing its tensors after it (``ProcessGroupGloo::runLoop``: ``execute(work)``,
then, under the queue's lock, ``workInProgress_[i].reset()`` and the loop's own ``work`` dropped — the decref that
takes the GIL). A fixed wait is a timing margin a loaded machine eats (1 of 8 launches aborted beside three busy
loops with a 0.2 s grace). The handler therefore makes the workers idle before the interpreter finalizes, in two
steps that need no timing assumption:

1. **drain**: a barrier on every gloo group this rank belongs to, issued asynchronously on all of them (so their
   order cannot deadlock) and waited for. gloo's barrier waits for every collective queued or running on its group
   when it was issued (``ProcessGroupGloo::barrier`` snapshots ``workInProgress_`` and ``workQueue_``), so after it
   no worker is inside a collective — a script's un-waited ``async_op=True`` work included. Every rank runs the
   handler at its exit, so the barrier is matched; a peer that never comes (it failed) makes the wait end at the
   deadline, with a warning.
2. **park**: the destroy, then the handler watches the workers (threads named ``pt_gloo_runloop``, read from
   ``/proc/self/task``) with the GIL released until every one is asleep (state ``S``) with its context-switch
   counters unchanged over two consecutive GIL-free intervals. A worker that still has a release to do is either
   runnable (``R``) or waiting for the GIL the handler has released — it then runs, and its counters move — so
   the only workers that pass are parked on the empty queue's condition variable, where nothing of Python's is
   touched again. Without ``/proc`` (not Linux) the handler falls back to holding the interpreter
   ``ACCEL_FP8_FIX_EXIT_GRACE`` seconds (default 0.2).

Both are bounded by ``ACCEL_FP8_FIX_EXIT_TIMEOUT`` (default 60 s) in all.

A script that ends with ``accelerator.end_training()`` (examples/demo.py) gets the same: stock's
``PartialState.destroy_process_group`` destroys the default group and returns while the referenced groups' workers
may still be releasing (4 of 10 launches aborted beside the heavy load, and examples/demo.py once in CI), so it is
wrapped to drain, destroy and park the same way; a script that destroys the group itself gets the park at exit. Only gloo groups are drained: NCCL's
watchdog and work threads never hold tensors with Python objects past ``wait()``.
Measured (one process, gloo group made by ``PartialState``, still referenced, 20 waited all-reduces, exit): stock
2 of 40 aborted; ``destroy_process_group()`` alone 1 of 40; with the grace 0 of 40. FSDP2 + fp8 + the config
flag on 2 processes under ``scripts/loaded.sh --heavy``: docs/failures.md A20.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from datetime import timedelta

from ... import caches
from ...engine.engine import calling_patch_set, is_applied

logger = logging.getLogger("accel_fp8_fix")

TIMEOUT_ENV = "ACCEL_FP8_FIX_EXIT_TIMEOUT"
DEFAULT_TIMEOUT_S = 60.0
GRACE_ENV = "ACCEL_FP8_FIX_EXIT_GRACE"
DEFAULT_GRACE_S = 0.2
TASKS = "/proc/self/task"  # this process's threads (Linux)
WORKER_NAME = "pt_gloo_runloop"  # ProcessGroupGloo::runLoop's thread name (c10::setThreadName)
SETTLE_S = 0.01  # one GIL-free interval between two looks at the workers
SETTLED_LOOKS = 2  # consecutive unchanged intervals that make a worker parked

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


def _forget_registration() -> None:
    """The exit handler unregistered (a process that runs several jobs: the next one's prepare registers anew)."""
    global _registered, _patch_set
    with _lock:
        if _registered:
            atexit.unregister(destroy_at_exit)
        _registered, _patch_set = False, None


caches.register("fixes.start.clean_exit: the exit handler's registration", _forget_registration)


def _fix_applied() -> bool:
    """The patch set that registered the handler is still applied (not undone since)."""
    return is_applied(_patch_set)


def _seconds(name: str, default: float) -> float:
    """A registered seconds setting (checked at ``Accelerator()``; see accel_fp8_fix/settings.py)."""
    from ... import settings

    value = settings.get(name)
    return default if value is None else max(float(value), 0.0)


def _timeout() -> float:
    return _seconds(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)


def _failing_exit() -> bool:
    """The interpreter is exiting on an unhandled exception (printed, and kept in sys.last_value)."""
    return getattr(sys, "last_value", None) is not None or getattr(sys, "last_exc", None) is not None


def destroy_at_exit() -> str:
    """The atexit handler; returns what it did (for tests): destroyed | parked: N | skipped: <why> | timed out."""
    dist = _dist()
    if dist is None:
        return "skipped: no process group"
    if not dist.is_initialized():
        if not (_registered and _fix_applied()):
            return "skipped: no process group"
        # destroyed before exit (end_training(), or the script's own destroy_process_group()): the groups FSDP2 and
        # the mesh still reference keep their worker threads, which may still be releasing the last collective's
        # tensors — wait until they are parked, as after our own destroy
        workers = wait_for_gloo_workers(time.monotonic() + _timeout())
        _warn_if_busy(workers)
        return workers
    if not _fix_applied():
        return "skipped: patch set not applied"
    if _fork_launched():
        return "skipped: fork-launched"
    if _failing_exit():
        return "skipped: unhandled exception"
    return drain_destroy_and_park(dist, dist.destroy_process_group)


def partial_state_destroy_process_group(wrapped, instance, args, kwargs):
    """``PartialState.destroy_process_group`` (what ``Accelerator.end_training()`` calls): for the default group
    accelerate created under this set, drain every gloo group, run stock's destroy, then wait until gloo's worker
    threads are parked — the exit handler's steps, so a script that ends with ``end_training()`` exits as cleanly
    as one that does not (stock's bare destroy left the still-referenced groups' workers racing teardown: 4 of 10
    launches aborted beside the heavy load, tests/distributed/test_clean_exit.py). Every rank calls it (as every
    rank calls end_training), so the barriers match; a rank that never comes ends the wait at the deadline."""
    group = args[0] if args else kwargs.get("group")
    dist = _dist()
    if (group is not None or dist is None or not dist.is_initialized() or not _registered or not _fix_applied()
            or _fork_launched()):
        return wrapped(*args, **kwargs)
    outcome = drain_destroy_and_park(dist, lambda: wrapped(*args, **kwargs))
    if outcome.startswith("skipped: ") and dist.is_initialized():  # the drain or destroy raised: stock's own error
        return wrapped(*args, **kwargs)
    return None


def drain_destroy_and_park(dist, destroy) -> str:
    """Drain every gloo group (a barrier each), ``destroy()``, then wait until gloo's workers are parked; all of it
    bounded by ``ACCEL_FP8_FIX_EXIT_TIMEOUT``. Returns destroyed | skipped: <error type> | timed out."""
    deadline = time.monotonic() + _timeout()
    errors: list[BaseException] = []

    def drain_and_destroy():
        try:
            _drain_gloo_groups(dist, deadline)
            destroy()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    try:
        worker = threading.Thread(target=drain_and_destroy, name="accel_fp8_fix-destroy-process-group", daemon=True)
        worker.start()
    except RuntimeError:  # Python >= 3.12 refuses new threads once finalization began: run inline
        drain_and_destroy()
    else:
        worker.join(_left(deadline))  # the GIL is released while waiting: workers finishing a collective can decref
        if worker.is_alive():
            logger.warning(
                "accel_fp8_fix: destroying the process group did not finish within %ss (%s); "
                "left to interpreter teardown", _timeout(), TIMEOUT_ENV)
            return "timed out"
    _warn_if_busy(wait_for_gloo_workers(deadline))
    if errors:
        logger.debug("accel_fp8_fix: draining / destroying the process groups failed: %r", errors[0])
        return f"skipped: {type(errors[0]).__name__}"
    return "destroyed"


def _warn_if_busy(workers: str) -> None:
    if workers == "busy":
        logger.warning("accel_fp8_fix: gloo's worker threads were still busy %ss after the process group was "
                       "destroyed (%s); left to interpreter teardown", _timeout(), TIMEOUT_ENV)


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.0)


def _drain_gloo_groups(dist, deadline: float) -> None:
    """A barrier on every gloo group this rank belongs to, all issued before any is waited for; each waited up to
    the deadline. A group whose barrier fails or times out (a peer gone) is logged and left to the destroy."""
    from ...distributed.collectives import barrier_async
    from ...internals import torch_internals

    works = []
    for group in torch_internals.process_groups():
        try:
            if dist.get_backend(group) != "gloo":
                continue
            works.append(barrier_async(group))
        except Exception as exc:  # noqa: BLE001
            logger.debug("accel_fp8_fix: exit barrier on a process group not issued: %r", exc)
    for work in works:
        try:
            work.wait(timeout=timedelta(seconds=max(_left(deadline), 0.001)))
        except Exception as exc:  # noqa: BLE001
            logger.warning("accel_fp8_fix: a process group's exit barrier did not complete (%s): a peer may have "
                           "failed or not reached its exit; its collectives are left to teardown", exc)


def _workers() -> dict[str, tuple[str, str, str]] | None:
    """{thread id: (state, voluntary, involuntary context switches)} of this process's gloo worker threads; None
    without ``/proc``. A thread that ends while being read is left out."""
    try:
        tids = os.listdir(TASKS)
    except OSError:
        return None
    found = {}
    for tid in tids:
        try:
            with open(f"{TASKS}/{tid}/comm") as comm:
                if comm.read().strip() != WORKER_NAME:
                    continue
            with open(f"{TASKS}/{tid}/status") as status:
                fields = dict(line.split(":", 1) for line in status if ":" in line)
        except OSError:
            continue
        found[tid] = tuple(_first_word(fields.get(key, ""))
                           for key in ("State", "voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"))
    return found


def _first_word(text: str) -> str:
    words = text.split()
    return words[0] if words else ""


def wait_for_gloo_workers(deadline: float) -> str:
    """Wait, GIL released, until every gloo worker thread is parked: asleep (``S``) with unchanged context-switch
    counters over ``SETTLED_LOOKS`` consecutive ``SETTLE_S`` intervals. Returns ``parked: N`` (N workers), ``busy``
    (the deadline came first), or ``grace`` (no ``/proc``: held ``ACCEL_FP8_FIX_EXIT_GRACE`` seconds instead)."""
    last = _workers()
    if last is None:
        time.sleep(min(_grace(), _left(deadline)))
        return "grace"
    settled = 0
    while True:
        if not last:
            return "parked: 0"
        if _left(deadline) <= 0:
            return "busy"
        time.sleep(SETTLE_S)
        now = _workers() or {}
        asleep = all(state == "S" for state, _, _ in now.values())
        settled = settled + 1 if now == last and asleep else 0
        if settled >= SETTLED_LOOKS:
            return f"parked: {len(now)}"
        last = now


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
