"""Which Transformer Engine release the emulation imitates (no torch import here)."""

from __future__ import annotations

# The TE release whose published Python source (transformer-engine==2.20.2 wheel) the emulation was
# checked against. The distribution the finder reports carries a local label so nobody mistakes it
# for the real package.
EMULATED_TE_VERSION = "2.20.2"
LOCAL_LABEL = "emulated"
DIST_VERSION = f"{EMULATED_TE_VERSION}+{LOCAL_LABEL}"
