"""One voice for the package's runtime messages.

Events go through ``logging.getLogger("accel_fp8_fix...")`` (a ``NullHandler`` on the package logger, as a
library should: the application decides what is shown). Each distinct message is emitted once per process,
and only by global rank 0 unless ``ACCEL_FP8_FIX_LOG_RANKS=all`` — a 4-rank job says things once, not 4 or 8
times. ``warnings.warn`` is kept for misuse (FP8 asked for and off, unsupported versions), pointed at the
user's line rather than at this package, wrapt or accelerate.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import warnings

from . import caches

logger = logging.getLogger("accel_fp8_fix")
logger.addHandler(logging.NullHandler())  # a library: the application decides what is shown

_lock = threading.Lock()
_said: set = set()


def _forget_said() -> None:
    with _lock:
        _said.clear()


caches.register("_log: messages said once", _forget_said)
_INTERNAL = (os.sep + "accel_fp8_fix" + os.sep, os.sep + "wrapt" + os.sep, os.sep + "accelerate" + os.sep,
             os.sep + "torch" + os.sep, "<frozen importlib")


def _rank() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except ImportError:  # pragma: no cover - torch absent
        pass
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def speaks() -> bool:
    """Does this process emit the package's messages (rank 0, or every rank when asked)?"""
    from . import settings

    return settings.get("ACCEL_FP8_FIX_LOG_RANKS") == "all" or _rank() == 0


def say(logger: logging.Logger, level: int, message: str) -> bool:
    """Log ``message`` once per process, from the speaking rank; True if it was emitted."""
    with _lock:
        if message in _said:
            return False
        _said.add(message)
    if not speaks():
        return False
    logger.log(level, message)
    return True


def _user_stacklevel() -> int:
    """``stacklevel`` for warnings.warn called from the function that calls this: the first frame
    outside this package, wrapt, accelerate and torch (the user's line)."""
    frame, level = sys._getframe(2), 2
    while frame is not None and any(part in frame.f_code.co_filename for part in _INTERNAL):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 2


def warn_user(message: str, category=RuntimeWarning) -> None:
    """A misuse warning at the user's line, once per process, from the speaking rank."""
    with _lock:
        key = ("warn", message)
        if key in _said:
            return
        _said.add(key)
    if speaks():
        warnings.warn(message, category, stacklevel=_user_stacklevel())
