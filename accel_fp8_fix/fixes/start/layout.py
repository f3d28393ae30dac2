"""Parallelism layouts accelerate refuses, refused here with the layout to use instead (fix id ``layout``).

accelerate 1.13-1.16 refuses some combinations of ``ParallelismConfig`` sizes, with messages that do not name a
layout that works (``dp_replicate x tp`` or ``x cp`` without ``dp_shard``: "set dp_replicate_size == 1 and
dp_shard_size > 1 to compose HSDP + TP/CP" — HSDP needs ``dp_replicate > 1``; 1.16 takes ``dp_replicate x tp``, and
then only an FP8 run is refused here: the FP8 fixes have not been tested on that layout). :func:`refused_layout` names the refusal and the layout to
use instead; the doctor (``accel-fp8-fix doctor --launch``) and ``Accelerator()`` / ``ParallelismConfig()`` (the
patches below, before accelerate's own checks run) say the same thing. Imports neither torch nor accelerate.
"""

from __future__ import annotations

import math
import os

from ...internals.accelerate_internals import replicate_with_tp_accepted

SIZE_KEYS = ("dp_replicate", "dp_shard", "tp", "cp", "sp")


def unknown_sizes(sizes: dict) -> dict:
    """The parallelism sizes above 1 this package does not know (``{"ep": 2}`` from a ``ParallelismConfig`` with
    ``ep_size``, a config's ``parallelism_config_ep_size`` or ``PARALLELISM_CONFIG_EP_SIZE``). Their mesh dimension
    would be misread — taken for data parallel wherever it carries ``Shard(0)`` — so they are refused by name."""
    out = {}
    for key, value in sizes.items():
        if key in SIZE_KEYS:
            continue
        try:
            if value is not None and int(value) != 1:
                out[key] = value
        except (TypeError, ValueError):
            out[key] = value
    return out


def unknown_sizes_message(unknown: dict, where: str) -> str:
    named = ", ".join(f"{where.format(key=key, KEY=key.upper())} = {value}" for key, value in unknown.items())
    return (f"accel_fp8_fix: {named}: a parallelism dimension this package does not know (it knows "
            f"{', '.join(SIZE_KEYS)}); its mesh dimension would be misread, so the FP8 fixes refuse it rather than "
            "shard, reduce or convert by guess. Set it to 1, or run without the package (ACCEL_FP8_FIX=0). "
            "(transformers' expert parallelism applied at load, DistributedConfig(ep_size=...), is recognised.)")


def _instance_sizes(instance) -> dict:
    """Every ``*_size`` attribute of a ``ParallelismConfig`` (a subclass's or a newer accelerate's included)."""
    names = set(getattr(instance, "__dataclass_fields__", {})) | set(vars(instance))
    return {name[: -len("_size")]: getattr(instance, name, None) for name in names if name.endswith("_size")}


def _env_unknown_sizes(environ) -> dict:
    prefix, suffix = "PARALLELISM_CONFIG_", "_SIZE"
    return unknown_sizes({k[len(prefix):-len(suffix)].lower(): v for k, v in environ.items()
                          if k.startswith(prefix) and k.endswith(suffix)})


def _product(sizes: dict) -> str:
    return " x ".join(f"{k} {v}" for k, v in sizes.items() if v > 1) or "all 1"


def _config_lines(sizes: dict) -> str:
    return ", ".join(f"parallelism_config_{k}_size: {v}" for k, v in sizes.items() if v > 1 or k == "dp_replicate")


def _replicate_without_shard(s: dict, fsdp: bool) -> tuple[str, str]:
    r, model = s["dp_replicate"], {k: s[k] for k in ("tp", "cp", "sp")}
    what = " x ".join(f"{k} {v}" for k, v in model.items() if v > 1)
    if what:
        reason = (f"dp_replicate {r} x {what} without dp_shard: accelerate refuses tensor / context parallelism over "
                  "plain replicated data parallelism (its message points at a layout HSDP cannot be)")
    else:
        reason = f"FSDP with dp_replicate {r} and dp_shard 1: accelerate refuses FSDP with no dimension to shard across"
    fsdp2 = {**s, "dp_replicate": 1, "dp_shard": r}
    instead = (f"{_product(fsdp2)} (FSDP2{' x ' + what if what else ''} on the same {math.prod(s.values())} processes: "
               f"{_config_lines(fsdp2)}; distributed_type: FSDP, fsdp_version: 2)")
    if r >= 4 and r % 2 == 0:
        hsdp = {**s, "dp_replicate": r // 2, "dp_shard": 2}
        instead += f", or {_product(hsdp)} (HSDP{' x ' + what if what else ''}: {_config_lines(hsdp)})"
    return reason, instead


def _replicate_tp_under_fp8(s: dict) -> tuple[str, str]:
    r, tp = s["dp_replicate"], s["tp"]
    fsdp2 = {**s, "dp_replicate": 1, "dp_shard": r}
    reason = (f"dp_replicate {r} x tp {tp} without dp_shard with mixed_precision fp8: accelerate 1.16 takes this "
              "layout (whole TP replicas, no FSDP), but this package's FP8 fixes (TE conversion, FP8 state over the "
              "mesh, checkpoints) have not been tested on it")
    instead = (f"{_product(fsdp2)} (FSDP2 x tp {tp} on the same {math.prod(s.values())} processes: "
               f"{_config_lines(fsdp2)}; distributed_type: FSDP, fsdp_version: 2), or the same layout in bf16 "
               "(stock accelerate)")
    return reason, instead


def refused_layout(sizes: dict, fsdp: bool | None = None, processes: int | None = None, fp8: bool | None = None,
                   replicate_tp: bool | None = None) -> tuple[str, str] | None:
    """``(what is refused, the layout to use instead)`` for these ``ParallelismConfig`` sizes (missing: 1), with FSDP
    on or off (``None``: not known yet) on ``processes`` processes (``None``: not known), FP8 on or off (``None``:
    not known); ``None`` when the layout is taken. ``replicate_tp``: whether accelerate takes ``dp_replicate x tp``
    without ``dp_shard`` (default: the installed accelerate's answer, 1.16 and later)."""
    s = {k: int(sizes.get(k) or 1) for k in SIZE_KEYS}
    total = math.prod(s.values())
    model_parallel = s["tp"] > 1 or s["cp"] > 1
    replicate_only = s["dp_replicate"] > 1 and s["dp_shard"] == 1
    if replicate_only and s["tp"] > 1 and s["cp"] == 1 and not fsdp:
        if replicate_tp is None:
            replicate_tp = replicate_with_tp_accepted()
        if replicate_tp:
            return _replicate_tp_under_fp8(s) if fp8 else None
    if replicate_only and (model_parallel or (fsdp and s["cp"] == 1)):
        return _replicate_without_shard(s, bool(fsdp))
    if fsdp and total > 1 and s["dp_shard"] == 1 and s["cp"] == 1:
        tp = s["tp"]
        instead = f"tp {tp} without FSDP (ParallelismConfig(tp_size={tp}), no fsdp_config: distributed_type MULTI_GPU)"
        if tp >= 4 and tp % 2 == 0:
            instead += f", or dp_shard 2 x tp {tp // 2} (FSDP2 x TP: parallelism_config_dp_shard_size: 2, parallelism_config_tp_size: {tp // 2})"
        return (f"FSDP with {_product(s)} and dp_shard 1: accelerate refuses FSDP with no dimension to shard across",
                instead)
    if processes and total > 1 and total != processes:
        rest = total // s["dp_shard"]
        instead = f"num_processes {total}"
        if processes % rest == 0:
            fitted = {**s, "dp_shard": processes // rest}
            instead += f", or {_product(fitted)} on {processes} processes (parallelism_config_dp_shard_size: {fitted['dp_shard']})"
        return (f"{_product(s)} multiplies to {total} but {processes} processes run: accelerate refuses the mismatch",
                instead)
    return None


def _message(refusal: tuple[str, str]) -> str:
    reason, instead = refusal
    return f"accel_fp8_fix: {reason}. Use {instead}."


def _env_sizes(environ) -> dict:
    return {k: environ.get(f"PARALLELISM_CONFIG_{k.upper()}_SIZE") for k in SIZE_KEYS}


def check_accelerator_kwargs(kwargs: dict, environ=None) -> None:
    """At ``Accelerator(...)``, before accelerate builds its state: the ``ParallelismConfig`` (given, or the one
    accelerate would build from the environment), FSDP on or off, and the process count; raises ``ValueError`` with
    the layout to use instead of a combination accelerate refuses."""
    environ = os.environ if environ is None else environ
    pc = kwargs.get("parallelism_config")
    # an unknown dimension matters to the FP8 fixes only: a bf16 / no-TE run stays exactly stock
    fp8 = str(kwargs.get("mixed_precision") or environ.get("ACCELERATE_MIXED_PRECISION", "no")).lower() == "fp8"
    if pc is not None:
        unknown = unknown_sizes(_instance_sizes(pc)) if fp8 else {}
        if unknown:
            raise ValueError(unknown_sizes_message(unknown, f"{type(pc).__name__}.{{key}}_size"))
        sizes = {k: getattr(pc, f"{k}_size", 1) for k in SIZE_KEYS}
    elif str(environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false")).lower() == "true":
        unknown = _env_unknown_sizes(environ) if fp8 else {}
        if unknown:
            raise ValueError(unknown_sizes_message(unknown, "PARALLELISM_CONFIG_{KEY}_SIZE"))
        sizes = _env_sizes(environ)
    else:
        return
    fsdp = kwargs.get("fsdp_plugin") is not None or str(environ.get("ACCELERATE_USE_FSDP", "false")).lower() == "true"
    try:
        processes = int(environ.get("WORLD_SIZE", "0")) or None
    except ValueError:
        processes = None
    refusal = refused_layout(sizes, fsdp=fsdp, processes=processes, fp8=fp8)
    if refusal is not None:
        raise ValueError(_message(refusal))


def parallelism_config_post_init(wrapped, instance, args, kwargs):
    """``ParallelismConfig.__post_init__``: a size combination accelerate refuses here (``dp_replicate x tp`` or
    ``x cp`` without ``dp_shard``) raises with the layout to use instead, before accelerate's own message. (A size
    this package does not know is refused at ``Accelerator()`` with FP8 on, where the precision is known.)"""
    sizes = {k: getattr(instance, f"{k}_size", None) for k in SIZE_KEYS}
    env = _env_sizes(os.environ)
    sizes = {k: (v if v is not None else env[k]) for k, v in sizes.items()}
    try:
        refusal = refused_layout(sizes, fsdp=None)
    except (TypeError, ValueError):  # a size that is not a number: accelerate's own check names it
        refusal = None
    if refusal is not None:
        raise ValueError(_message(refusal))
    return wrapped(*args, **kwargs)
