"""Helpers for checking the TE emulation against Transformer Engine's published Python source.

* :mod:`.extract`  -- pure-``ast`` extraction of TE's Python contract from a wheel (no import of TE).
* :mod:`.wheels`   -- obtains (and caches) ``transformer-engine`` wheels with ``pip download``.
* :mod:`.emulated` -- reads the same contract from ``accel_fp8_fix.emulation`` (in-process).
* :mod:`.compare`  -- compares the two and words each drift per TE version.
"""
