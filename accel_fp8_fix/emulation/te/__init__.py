"""Emulated ``transformer_engine`` top-level package (CPU emulation by accel_fp8_fix; not real TE).

Imported as ``transformer_engine`` once ``accel_fp8_fix.emulation.install()`` ran. No torch import
here; ``transformer_engine.pytorch`` imports torch.
"""

from accel_fp8_fix.emulation._version import DIST_VERSION as __version__  # noqa: F401

from . import common  # noqa: F401  (real TE imports transformer_engine.common at top level)

__emulated__ = True
