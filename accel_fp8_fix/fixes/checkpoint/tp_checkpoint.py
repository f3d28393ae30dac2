"""Checkpoints of a tensor-parallel model without FSDP (A21), and the refusals of what DCP cannot reshard.

Under pure TP (``ParallelismConfig(tp_size=N)``, no FSDP) stock accelerate saves the model like a DDP one: a
``state_dict`` of DTensor parameters through ``clean_state_dict_for_safetensors``, which asks each for its storage
pointer — ``RuntimeError: Attempted to access the data pointer on an invalid python storage.`` in ``save_state``
and in ``save_model``, FP8 or not. Here:

* ``save_state`` writes the models and optimizers as a sharded DCP checkpoint in the directories accelerate's
  FSDP2 sharded path uses (``pytorch_model_fsdp_<i>/`` with ``{"model": ...}``, ``optimizer_<i>/`` with
  ``{"optimizer": ...}``), every weight, optimizer state and TE ``_extra_state`` (FP8 state) included; the rest
  (schedulers, samplers, RNG, custom objects) is stock. ``load_state`` reads it back with DCP, which reshards:
  the same checkpoint loads on another TP degree, and under FSDP2 or FSDP2 x TP (and theirs under TP).
* ``save_model`` writes full tensors (each DTensor gathered on its mesh) without the FP8 state: the export
  plain transformers loads.
* before a sharded load (this path or accelerate's FSDP2 one), the checkpoint's metadata is compared with the
  model: a missing entry or a global shape that differs is refused by name before any tensor is read. TP-packed
  parameters (``_StridedShard``, A16) go through DCP as one chunk per row range (``packed_checkpoint``).
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import os

from ...distributed.dtensor import is_dtensor
from ...internals.accelerate_internals import prepared_models, prepared_optimizers

MODEL_NAME = "pytorch_model_fsdp"  # accelerate's FSDP_MODEL_NAME: the FSDP2 sharded path's directory names
OPTIMIZER_NAME = "optimizer"  # accelerate's OPTIMIZER_NAME

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("accel_fp8_fix_tp_checkpoint", default=None)


def is_tp_without_fsdp(accelerator) -> bool:
    """A prepared model holds DTensor parameters and accelerate would save it like a DDP model (no FSDP, DeepSpeed
    or Megatron path): the layout stock ``save_state`` / ``save_model`` fail on."""
    kind = getattr(getattr(accelerator, "distributed_type", None), "name", "")
    if kind in ("FSDP", "DEEPSPEED", "MEGATRON_LM") or getattr(accelerator, "is_fsdp2", False):
        return False
    return any(is_dtensor(p) for m in prepared_models(accelerator) for p in m.parameters())


@contextlib.contextmanager
def sharded_checkpoint(accelerator):
    """Inside ``save_state`` / ``load_state`` of a TP model without FSDP: the models and optimizers go through DCP
    (the ``save_accelerator_state`` / ``load_accelerator_state`` wrappers below read this)."""
    token = _ACTIVE.set(accelerator if is_tp_without_fsdp(accelerator) else None)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def _bind(wrapped, args, kwargs) -> inspect.BoundArguments:
    return inspect.signature(wrapped).bind(*args, **kwargs)


def _call(wrapped, bound):
    return wrapped(*bound.args, **bound.kwargs)


def save_accelerator_state(wrapped, instance, args, kwargs):
    """``accelerate.accelerator.save_accelerator_state`` inside a TP ``save_state``: models and optimizers written
    with DCP first, then the stock function for everything else (no model state, no optimizer)."""
    accelerator = _ACTIVE.get()
    if accelerator is None:
        return wrapped(*args, **kwargs)
    bound = _bind(wrapped, args, kwargs)
    save_sharded(accelerator, str(bound.arguments["output_dir"]))
    bound.arguments["model_states"], bound.arguments["optimizers"] = [], []
    return _call(wrapped, bound)


def load_accelerator_state(wrapped, instance, args, kwargs):
    """``accelerate.accelerator.load_accelerator_state`` inside a TP ``load_state``: every model / optimizer
    checked against the checkpoint, then loaded with DCP; the stock function loads the rest."""
    accelerator = _ACTIVE.get()
    if accelerator is None:
        return wrapped(*args, **kwargs)
    bound = _bind(wrapped, args, kwargs)
    load_sharded(accelerator, str(bound.arguments["input_dir"]))
    bound.arguments["models"], bound.arguments["optimizers"] = [], []
    return _call(wrapped, bound)


def _dirs(root: str, i: int) -> tuple[str, str]:
    suffix = f"_{i}"
    return os.path.join(root, MODEL_NAME + suffix), os.path.join(root, OPTIMIZER_NAME + suffix)


def _pairs(accelerator):
    """[(model, optimizer or None)] as accelerate pairs them (optimizer i with model i)."""
    models, optimizers = prepared_models(accelerator), prepared_optimizers(accelerator)
    return [(m, optimizers[i] if i < len(optimizers) else None) for i, m in enumerate(models)]


def save_sharded(accelerator, output_dir: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    pairs = _pairs(accelerator)
    for i, (model, optimizer) in enumerate(pairs):
        model_dir, optim_dir = _dirs(output_dir, i)
        os.makedirs(model_dir, exist_ok=True)
        dcp.save({"model": get_model_state_dict(model)}, storage_writer=dcp.FileSystemWriter(model_dir))
        if optimizer is not None:
            os.makedirs(optim_dir, exist_ok=True)
            state = get_optimizer_state_dict(model, getattr(optimizer, "optimizer", optimizer))
            dcp.save({"optimizer": state}, storage_writer=dcp.FileSystemWriter(optim_dir))


def load_sharded(accelerator, input_dir: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    pairs = _pairs(accelerator)
    _refuse_on_every_rank(accelerator, input_dir, pairs)  # every model and optimizer, before anything is read
    for i, (model, optimizer) in enumerate(pairs):
        model_dir, optim_dir = _dirs(input_dir, i)
        state = {"model": get_model_state_dict(model)}
        dcp.load(state, storage_reader=dcp.FileSystemReader(model_dir))
        set_model_state_dict(model, state["model"])
        if optimizer is not None:
            inner = getattr(optimizer, "optimizer", optimizer)
            ostate = {"optimizer": get_optimizer_state_dict(model, inner)}
            dcp.load(ostate, storage_reader=dcp.FileSystemReader(optim_dir))
            set_optimizer_state_dict(model, inner, ostate["optimizer"])


def _flat_tensors(prefix: str, value, out: dict) -> dict:
    """{DCP key: global shape} of the tensors of a nested state dict (DCP joins nested keys with '.')."""
    if isinstance(value, dict):
        for k, v in value.items():
            _flat_tensors(f"{prefix}.{k}", v, out)
    elif hasattr(value, "shape") and hasattr(value, "dtype"):
        out[prefix] = tuple(value.shape)
    return out


def _problems(ckpt_dir: str, wanted: dict) -> list[str]:
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(ckpt_dir).read_metadata().state_dict_metadata
    problems = []
    for key, shape in wanted.items():
        entry = metadata.get(key)
        name = key.partition(".")[2]  # without DCP's top-level "model." / "optimizer."
        if entry is None:
            problems.append(f"{name} is not in the checkpoint")
        elif hasattr(entry, "size") and tuple(entry.size) != shape and not _same_kind_of_fp8_state(
                key, tuple(entry.size), shape):
            problems.append(f"{name} is {tuple(entry.size)} in the checkpoint but {shape} in this model")
    return problems


def _same_kind_of_fp8_state(key: str, saved: tuple, here: tuple) -> bool:
    """A TE ``_extra_state`` is a pickle: its byte count is no layout property (a recompute adds an entry, other
    processes pickle other lengths) and the load resizes it to the checkpoint's (fixes/checkpoint/checkpoint.py:
    ``extra_state_sized_as``). FP8 state on one side and none on the other still differ (bf16 into FP8)."""
    return key.endswith("._extra_state") and len(saved) == len(here) == 1 and (saved[0] > 0) == (here[0] > 0)


def extra_state_sizes(input_dir: str) -> dict:
    """{state-dict key of a TE ``_extra_state``: its byte count} in model 0's sharded checkpoint (empty when there is
    none); read from DCP's metadata, no tensor read."""
    import torch.distributed.checkpoint as dcp

    model_dir = _dirs(input_dir, 0)[0]
    if not os.path.isdir(model_dir):
        return {}
    metadata = dcp.FileSystemReader(model_dir).read_metadata().state_dict_metadata
    return {key.partition(".")[2]: int(entry.size[0]) for key, entry in metadata.items()
            if key.endswith("._extra_state") and hasattr(entry, "size") and len(entry.size) == 1}


def _refuse_on_every_rank(accelerator, input_dir: str, pairs, only_if_present: bool = False) -> None:
    """:func:`refuse_unreshardable` decided by the ranks together: a refusal (or a failure to read the checkpoint's
    metadata) on any rank raises on every rank, naming the rank — never one rank leaving while the others wait in
    DCP's collectives. ``only_if_present``: a rank that does not see model 0's sharded checkpoint has nothing to
    refuse (every rank still takes part in the agreement)."""
    from ...distributed import collectives

    try:
        if not only_if_present or os.path.isdir(_dirs(input_dir, 0)[0]):
            refuse_unreshardable(accelerator, input_dir, pairs)
        mine = None
    except Exception as exc:  # noqa: BLE001 - shared with the other ranks, then raised on every one
        mine = f"{type(exc).__name__}: {exc}"
    mesh = getattr(accelerator, "torch_device_mesh", None)
    if mesh is None:  # one rank, or a plain FSDP2 run without a ParallelismConfig: every rank of the world
        import torch.distributed as dist

        group = dist.group.WORLD if dist.is_initialized() else None
        found = [mine] if group is None else collectives.all_gather_object(mine, group=group,
                                                                             name="load_state refusal")
    else:
        found = collectives.all_gather_object(mine, mesh, name="load_state refusal")
    failed = [(rank, error) for rank, error in enumerate(found) if error is not None]
    if failed:
        rank, error = failed[0]
        message = error.split(": ", 1)[1] if error.startswith("ValueError: ") else error
        raise ValueError(message if len(failed) == len(found) else f"{message} (on rank {rank} of the mesh)")


def refuse_unreshardable(accelerator, input_dir: str, pairs=None) -> None:
    """Compare a sharded checkpoint's metadata (``pytorch_model_fsdp_<i>`` / ``optimizer_<i>``) with the prepared
    models and optimizers; raise ``ValueError`` naming what DCP cannot load into them — before any tensor is read."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    pairs = _pairs(accelerator) if pairs is None else pairs
    problems = []
    for i, (model, optimizer) in enumerate(pairs):
        model_dir, optim_dir = _dirs(input_dir, i)
        if not os.path.isdir(model_dir):
            found = sorted(os.listdir(input_dir)) if os.path.isdir(input_dir) else []
            raise ValueError(
                f"accel_fp8_fix: load_state of a tensor-parallel model reads a sharded (DCP) checkpoint from {model_dir}, "
                f"which does not exist (in {input_dir}: {', '.join(found) or 'nothing'}). A checkpoint that stock "
                "accelerate wrote without FSDP holds plain tensors: load it into the model before accelerator.prepare.")
        problems += [f"model {i}: {p}" for p in _problems(model_dir, _flat_tensors("model", get_model_state_dict(model), {}))]
        if optimizer is not None and os.path.isdir(optim_dir):
            state = get_optimizer_state_dict(model, getattr(optimizer, "optimizer", optimizer))
            wanted = _flat_tensors("optimizer.state", state.get("state", {}), {})
            problems += [f"optimizer {i}: {p}" for p in _problems(optim_dir, wanted)]
    if problems:
        raise ValueError(
            f"accel_fp8_fix: load_state refuses {input_dir} before reading it: torch.distributed.checkpoint reshards "
            "across layouts and process counts, but cannot load what this model does not match: "
            + "; ".join(problems[:6]) + (f"; and {len(problems) - 6} more" if len(problems) > 6 else "")
            + ". The model (config, FP8 on or off, FP8 recipe and amax_history_len) must be the one that was saved.")


def save_model(wrapped, instance, args, kwargs):
    """``Accelerator.save_model`` of a TP model without FSDP: the state dict ``get_state_dict`` returns (FP8 state
    already left out) has each DTensor gathered to its full tensor on its mesh, on every rank; the stock function
    writes it (main process)."""
    if not is_tp_without_fsdp(instance):
        return wrapped(*args, **kwargs)
    bound_get = instance.get_state_dict

    def get_state_dict(model, unwrap=True):
        state = bound_get(model, unwrap)
        return {k: (v.full_tensor() if is_dtensor(v) else v) for k, v in state.items()} if state else state

    instance.get_state_dict = get_state_dict
    try:
        return wrapped(*args, **kwargs)
    finally:
        del instance.get_state_dict


def check_sharded_load(accelerator, input_dir) -> None:
    """Before accelerate's FSDP2 sharded load of an explicit ``input_dir``: the same refusal as the TP path (what
    DCP cannot load into the FSDP2 model, named before anything is read)."""
    plugin = getattr(getattr(accelerator, "state", None), "fsdp_plugin", None)
    if (input_dir is None or not getattr(accelerator, "is_fsdp2", False) or plugin is None
            or "SHARDED" not in str(getattr(plugin, "state_dict_type", ""))):
        return
    _refuse_on_every_rank(accelerator, os.path.expanduser(str(input_dir)), None, only_if_present=True)
