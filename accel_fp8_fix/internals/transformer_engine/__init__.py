"""Transformer Engine internals (being split by job: the whole module moved here first, so history follows)."""

from .float8_tensors import *  # noqa: F401,F403
from .float8_tensors import _FORKS, _GUARD_FILE, _GUARD_SOURCES, _SOURCES  # noqa: F401
