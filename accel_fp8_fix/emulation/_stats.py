"""Per-process counters of the Transformer Engine emulation (no torch import here)."""

from __future__ import annotations

import copy
import threading

_lock = threading.Lock()


def _fresh() -> dict:
    return {
        "fp8_gemms": 0,  # FP8 GEMMs executed, forward + backward
        "fp8_gemms_fwd": 0,
        "fp8_gemms_bwd": 0,
        "non_fp8_gemms": 0,  # high-precision GEMMs executed by emulated modules, forward + backward
        "non_fp8_gemms_fwd": 0,
        "non_fp8_gemms_bwd": 0,
        "amax_reductions": 0,  # all_reduce(MAX) calls issued for DelayedScaling amaxes
        "amax_reductions_fwd": 0,
        "amax_reductions_bwd": 0,
        "amax_reduction_groups": [],  # per reduction: "WORLD" or the sorted list of global ranks
        "amax_elements_reduced": 0,  # total number of amax values all-reduced
        "scale_updates": 0,  # delayed-scaling amax/scale updates (one per buffer key per exit/backward)
    }


_STATS = _fresh()


def bump(key: str, n: int = 1) -> None:
    with _lock:
        _STATS[key] += n


def record_reduction(group_desc, numel: int, forward: bool) -> None:
    with _lock:
        _STATS["amax_reductions"] += 1
        _STATS["amax_reductions_fwd" if forward else "amax_reductions_bwd"] += 1
        _STATS["amax_reduction_groups"].append(group_desc)
        _STATS["amax_elements_reduced"] += int(numel)


def stats() -> dict:
    with _lock:
        return copy.deepcopy(_STATS)


def reset_stats() -> None:
    global _STATS
    with _lock:
        _STATS = _fresh()
