"""CPU rehearsal gates: make accelerate run its real FSDP2 / ParallelismConfig / TP code on CPU processes.

    from accel_fp8_fix.rehearsal import gates
    gates.activate()      # or ACCEL_FP8_FIX_REHEARSAL=1, which also puts TE's Python on CPU (see rehearsal/)

Stock accelerate, on a machine without CUDA, never reaches its FSDP2 or TP code:

* under ``torchrun`` (``LOCAL_RANK`` set) without ``cpu=True``, ``PartialState._prepare_backend`` finds no
  accelerator and returns ``(None, DistributedType.NO)``: every rank runs undistributed, silently;
* with ``cpu=True`` (or ``ACCELERATE_USE_CPU``) it returns ``("gloo", MULTI_CPU)``; ``AcceleratorState``
  only turns MULTI_GPU-like types into ``FSDP``, so the FSDP plugin is ignored and the model is wrapped in
  DDP, and ``ParallelismConfig._validate_accelerator`` raises "ParallelismConfig is only compatible
  DistributedType.FSDP (version 2) or ...".

The rehearsal lifts exactly these gates, with two wrappers (declared in
``patches/rehearsal-accelerate-1.13-1.16.toml``, applied by the patch engine):

``AcceleratorState.__init__`` (:func:`accelerator_state_init`)
    When nothing is initialised yet, no CUDA device exists, the process was started by a torchrun-style
    launcher (``LOCAL_RANK`` set) and the Accelerator asks for FSDP2 (``fsdp_plugin.fsdp_version == 2``)
    or a ``ParallelismConfig`` with a ``dp_shard`` / ``tp`` / ``cp`` dimension, it first creates the
    ``PartialState`` itself with ``cpu=False`` (and the caller's init-process-group kwargs) while the
    backend gate below is open, then runs the stock ``__init__``, which then picks ``FSDP`` for an FSDP
    plugin exactly as on GPUs.
``PartialState._prepare_backend`` (:func:`prepare_backend`)
    Only while that decision is open (or, for a ``PartialState`` created before any ``Accelerator`` with
    ``cpu=False``, when the launcher's environment asks for FSDP2 / a sharded ParallelismConfig:
    ``ACCELERATE_USE_FSDP=true`` + ``FSDP_VERSION=2``, ``ACCELERATE_USE_PARALLELISM_CONFIG`` with
    ``PARALLELISM_CONFIG_{DP_SHARD,TP,CP}_SIZE > 1``), and only if the stock answer is ``NO`` / ``MULTI_CPU``
    (no accelerator found) and CUDA is unavailable: returns ``("gloo", DistributedType.MULTI_GPU)`` and pins
    ``state.device`` to ``cpu`` (so ``set_device()`` does not look for CUDA). ``PartialState`` then
    initialises the gloo process group through its normal (GPU) branch.

Everything after that is accelerate's own code: ``Accelerator.__init__`` builds
``ParallelismConfig.get_device_mesh("cpu")``, ``prepare()`` runs ``_prepare_tp`` / ``_prepare_te`` /
``_prepare_fsdp2`` / ``fully_shard``. Runs that ask for neither FSDP2 nor a sharded mesh (plain DDP, single
process, FSDP1) are left to stock accelerate; with CUDA present the wrappers pass every call through.
"""

from __future__ import annotations

import logging
import os
import threading

__all__ = ["activate", "deactivate", "is_active", "is_applied", "last_decision", "accelerator_state_init", "prepare_backend"]

from .._log import say

logger = logging.getLogger(__name__)

_lock = threading.RLock()
_engine = None
_local = threading.local()  # .wanted: the reason string while AcceleratorState decides, else None
_last_decision: dict = {}


# -- activation -----------------------------------------------------------------------------------------
def activate(strict: bool = True):
    """Apply the rehearsal patch set (now, or when accelerate is imported). Idempotent.

    Raises ``RuntimeError`` when no rehearsal set fits the installed accelerate / torch (a rehearsal that
    silently does nothing would run every rank undistributed), and, with ``strict``, ``PatchError`` when a
    target's signature changed. Returns the engine.
    """
    global _engine
    from .._api import choose_patch_set, engine_for

    with _lock:
        selection = choose_patch_set("rehearsal")
        if not selection.supported:
            raise RuntimeError(f"accel_fp8_fix rehearsal: not activated: {selection.reason}")
        engine = engine_for(selection.patch_set)
        engine.activate(strict=strict)
        _engine = engine
        return engine


def deactivate() -> list:
    """Undo the rehearsal wrappers (exactly); returns the engine's warnings about foreign wrappers."""
    with _lock:
        if _engine is None:
            return []
        messages = _engine.deactivate()
        for message in messages:
            say(logger, logging.WARNING, f"accel_fp8_fix rehearsal: {message}")
        return messages


def is_active() -> bool:
    """True once activate() was called (and not undone); the wrappers apply when accelerate is imported."""
    return _engine is not None and _engine.active


def is_applied() -> bool:
    """True when the rehearsal wrappers are installed on accelerate right now."""
    return _engine is not None and _engine.applied


def last_decision() -> dict:
    """What the gate decided for this process's AcceleratorState (empty until one was built)."""
    return dict(_last_decision)


# -- the decision ---------------------------------------------------------------------------------------
def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _state_args(
    mixed_precision=None,
    cpu=False,
    dynamo_plugin=None,
    deepspeed_plugin=None,
    fsdp_plugin=None,
    torch_tp_plugin=None,
    megatron_lm_plugin=None,
    parallelism_config=None,
    _from_accelerator=False,
    **kwargs,
):
    """The arguments of ``AcceleratorState.__init__`` by name (its signature is pinned by the patch set)."""
    return {
        "cpu": cpu,
        "fsdp_plugin": fsdp_plugin,
        "parallelism_config": parallelism_config,
        "deepspeed_plugin": deepspeed_plugin,
        "megatron_lm_plugin": megatron_lm_plugin,
        "kwargs": kwargs,
    }


def _wanted(bound: dict) -> str | None:
    """Why this Accelerator needs accelerate's GPU-shaped path on CPU, or None (then stock decides)."""
    why = []
    plugin = bound["fsdp_plugin"]
    if plugin is not None and getattr(plugin, "fsdp_version", 1) == 2:
        why.append("FSDP2 plugin")
    pc = bound["parallelism_config"]
    if pc is not None:
        dims = [d for d in ("dp_shard", "tp", "cp") if getattr(pc, f"{d}_enabled", False)]
        if dims:
            why.append("ParallelismConfig(" + ", ".join(f"{d}_size={getattr(pc, f'{d}_size')}" for d in dims) + ")")
    return " + ".join(why) or None


def _env_wanted() -> str | None:
    """The same intent read from the launcher's environment (``accelerate launch`` exports it), for a
    ``PartialState`` created before any ``Accelerator`` (e.g. by ``TrainingArguments`` or a script)."""
    env = os.environ
    why = []
    if env.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and env.get("FSDP_VERSION", "1") == "2":
        why.append("FSDP2 (ACCELERATE_USE_FSDP, FSDP_VERSION=2)")
    if env.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() == "true":
        dims = [d for d in ("dp_shard", "tp", "cp") if int(env.get(f"PARALLELISM_CONFIG_{d.upper()}_SIZE", "1") or 1) > 1]
        if dims:
            why.append("ParallelismConfig from the environment (" + ", ".join(f"{d}_size>1" for d in dims) + ")")
    if env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true" or env.get("LOCAL_RANK") in (None, "", "-1"):
        return None
    return " + ".join(why) or None


def _warn_if_cpu_state_drops(shared: dict, bound: dict) -> None:
    """A ``PartialState`` created with ``cpu=True`` before this Accelerator — ``TrainingArguments(use_cpu=True)``
    or ``ACCELERATE_USE_CPU`` — is ``MULTI_CPU``: stock then wraps the model in DDP and drops the FSDP2 plugin
    (and refuses a sharded ParallelismConfig). One warning naming what is dropped, instead of a silent DDP run."""
    from accelerate.utils import DistributedType

    reason = _wanted(bound)
    if (reason is None or shared.get("distributed_type") != DistributedType.MULTI_CPU
            or bound["deepspeed_plugin"] is not None or _cuda_available()):
        return
    _last_decision.clear()
    _last_decision.update(acted=False, reason=reason, why_not="PartialState created with cpu=True (MULTI_CPU)")
    from .._log import warn_user

    warn_user(
        f"accel_fp8_fix rehearsal: the distributed state was created with cpu=True (TrainingArguments(use_cpu=True) "
        f"or ACCELERATE_USE_CPU) before this Accelerator, so accelerate runs MULTI_CPU (DDP) and drops the {reason} "
        "of your config: no FSDP2 sharding, accel_fp8_fix's fixes are off and FP8 is not applied by them. Under "
        "ACCEL_FP8_FIX_REHEARSAL=1 the run is on CPU already: remove use_cpu=True (and ACCELERATE_USE_CPU)")


def accelerator_state_init(wrapped, instance, args, kwargs):
    """``AcceleratorState.__init__``: open the backend gate for FSDP2 / sharded-mesh runs on CPU processes."""
    from accelerate.state import PartialState

    if PartialState._shared_state and os.environ.get("LOCAL_RANK") not in (None, "", "-1"):
        _warn_if_cpu_state_drops(PartialState._shared_state, _state_args(*args, **kwargs))
    if PartialState._shared_state or os.environ.get("LOCAL_RANK") in (None, "", "-1"):
        return wrapped(*args, **kwargs)  # already decided, or not started by a torchrun-style launcher
    bound = _state_args(*args, **kwargs)
    reason = _wanted(bound)
    if reason is None or bound["deepspeed_plugin"] is not None or bound["megatron_lm_plugin"] is not None:
        return wrapped(*args, **kwargs)
    if _cuda_available():
        return wrapped(*args, **kwargs)  # a real GPU run: never touch it
    _local.wanted = reason
    try:
        # cpu=False: with cpu=True PartialState takes its MULTI_CPU branch (DDP, FSDP plugin ignored).
        PartialState(False, **bound["kwargs"])
    finally:
        _local.wanted = None
    return wrapped(*args, **kwargs)


def prepare_backend(wrapped, instance, args, kwargs):
    """``PartialState._prepare_backend``: ("gloo", MULTI_GPU) on CPU while the decision above is open."""
    backend, distributed_type = wrapped(*args, **kwargs)
    reason = getattr(_local, "wanted", None)
    cpu = kwargs.get("cpu", args[0] if args else False)
    if reason is None and not cpu:
        # A PartialState created on its own (no Accelerator yet): only the launcher's environment tells.
        # (With cpu=True PartialState would not initialise the process group on the MULTI_GPU branch.)
        reason = _env_wanted()
    if reason is None:
        return backend, distributed_type
    import torch
    from accelerate.utils import DistributedType

    requested = kwargs.get("backend", args[2] if len(args) > 2 else None)
    device = getattr(instance, "device", None)
    if (
        distributed_type not in (DistributedType.NO, DistributedType.MULTI_CPU)
        or requested not in (None, "gloo")
        or (device is not None and device.type != "cpu")
        or _cuda_available()
    ):
        _last_decision.clear()
        _last_decision.update(acted=False, reason=reason, why_not=f"stock chose {backend}/{distributed_type}")
        return backend, distributed_type
    instance.device = torch.device("cpu")  # set_device() returns early: no CUDA lookup
    _last_decision.clear()
    _last_decision.update(acted=True, reason=reason, stock=f"{backend}/{distributed_type}")
    say(logger, logging.WARNING,
        f"accel_fp8_fix rehearsal: no CUDA device; {reason} requested -> running accelerate's GPU code path on "
        "CPU (backend gloo, device cpu, distributed type MULTI_GPU, FSDP with an FSDP plugin; stock would have "
        f"chosen {backend}/{distributed_type})")
    return "gloo", DistributedType.MULTI_GPU
