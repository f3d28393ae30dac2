"""What every rank of one run computes alike, computed once: ``@once_per_run``.

A one-process reference (the same model trained in one process on the whole batch, what a multi-rank run is
compared with) comes out the same on every rank of the run; computed by each rank, it costs world-size times the
work on the cores the ranks share (4 ranks on the 2-core CI machine: twice the wall time, the other ranks waiting
for the slowest anyway). Decorated, the first rank of the run to call it with given arguments computes it, under a
lock on a file of the run's shared folder, and stores the result; the other ranks wait on the lock and read it.

    from accel_fp8_fix.testing.shared import once_per_run

    @once_per_run
    def reference(family: str, steps: int): ...

* The arguments are the key, so they must be plain data (None, bool, int, float, str, and tuples, lists and dicts
  of these): a callable or a tensor argument raises TypeError — its identity could differ between ranks, or name
  different computations on each.
* The computation runs as in one process: ``torch.distributed.is_initialized()`` answers False while it runs (the
  ranks that read its result issue no collective with it), and torch's default generator is put back after it (a
  rank that read the result drew nothing from it either).
* Every rank gets the stored copy (the computing rank too): equal objects on every rank.
* Whatever else the function does to its process happens on the computing rank only: where the ranks go on from
  such state, put every rank in the same one after the call (the suite's references end by resetting Transformer
  Engine's global FP8 state, so ``tests/support/fp8_scenarios.one_process_reference`` resets it on every rank —
  without that, the readers kept the amax buffers of an earlier run and their next reduction had other sizes).
* Outside a run of the test bed (:func:`accel_fp8_fix.testing.run_distributed`, a rank pool) the function is
  simply called. The folder goes with the run, and with it every result.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import inspect
import os
import pickle
from pathlib import Path

__all__ = ["once_per_run", "run_dir"]

_run_dir: Path | None = None  # set by the rank process for the length of a run (_worker.py, _pool_worker.py)


def run_dir() -> Path | None:
    """The folder every rank of the current run shares (None outside a run)."""
    return _run_dir


@contextlib.contextmanager
def during_run(folder: str | os.PathLike | None):
    """Used by the rank processes: ``folder`` is the run's shared folder while the run's function runs."""
    global _run_dir
    _run_dir = Path(folder) if folder is not None else None
    try:
        yield
    finally:
        _run_dir = None


_PLAIN = (type(None), bool, int, float, str)


def _plain(value, where: str):
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (tuple, list)):
        return type(value).__name__, tuple(_plain(v, where) for v in value)
    if isinstance(value, dict):
        return "dict", tuple(sorted((_plain(k, where), _plain(v, where)) for k, v in value.items()))
    raise TypeError(f"once_per_run: {where} is a {type(value).__name__}; the arguments are the key shared by the "
                    "ranks, so they must be plain data (None, bool, int, float, str, tuples / lists / dicts of these)")


def _key(fn, args: tuple, kwargs: dict) -> tuple:
    """The call's arguments bound to ``fn``'s parameters, defaults applied: ``f(1, b=2)`` and ``f(1, 2)`` are one key."""
    name = f"{fn.__module__}.{fn.__qualname__}"
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    return name, tuple((k, _plain(v, f"{name}'s argument {k!r}")) for k, v in bound.arguments.items())


@contextlib.contextmanager
def _as_one_process():
    import torch
    import torch.distributed as dist

    is_initialized = dist.is_initialized
    dist.is_initialized = lambda: False
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        dist.is_initialized = is_initialized


def once_per_run(fn):
    """``fn`` computed by one rank of a run for every rank of it (module docstring)."""

    @functools.wraps(fn)
    def computed_once(*args, **kwargs):
        folder = _run_dir
        if folder is None:
            return fn(*args, **kwargs)
        key = _key(fn, args, kwargs)
        stem = folder / hashlib.sha256(repr(key).encode()).hexdigest()[:24]
        stored = stem.with_suffix(".pkl")
        with open(stem.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # bounded: the test bed kills a run's ranks at its deadline
            try:
                if not stored.exists():
                    with _as_one_process():
                        result = fn(*args, **kwargs)
                    partial = stem.with_suffix(f".{os.getpid()}.partial")
                    partial.write_bytes(pickle.dumps((key, result)))
                    partial.replace(stored)
                stored_key, result = pickle.loads(stored.read_bytes())
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
        if stored_key != key:
            raise RuntimeError(f"once_per_run: {stored} holds {stored_key[0]}, not {key[0]} (a digest collision)")
        return result

    return computed_once
