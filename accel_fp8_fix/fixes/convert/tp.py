"""Tensor parallelism for TE (A8, A9, A10): accelerate's ``_prepare_tp`` without transformers internals.

Stock ``_prepare_tp`` (FSDP2 x TP) imports ``transformers.integrations.tensor_parallel.ReplicateParallel``,
which transformers 5.x no longer has (A10), to wrap the parameters TP left plain as ``Replicate``
DTensors on ``mesh["tp"]``. Here this package does that itself: each plain parameter becomes a
``Replicate`` DTensor Parameter (no copy, ``from_local``), its module gets forward hooks that hand the
module its local tensors (so a plain activation never meets a DTensor parameter), and the optimizer is
pointed at the new Parameter objects. The model is then DTensor-native outside forward, so FSDP2's
2-D sharding, ``clip_grad_norm_`` (A9) and DCP see one kind of tensor.

A module transformers gave ``replicated_with_grad_allreduce`` (Qwen3 / Gemma3 ``q_norm`` / ``k_norm``) would
register a gradient hook on the local tensor — not a leaf — at its first forward (5.24: "post accumulate grad hooks
cannot be registered on non-leaf tensors"), or on the DTensor parameter, whose DTensor gradient it then hands to
``dist.all_reduce`` (5.25: "c10d.allreduce_.default does not have a sharding strategy registered") (A15): the style
is taken off the module (either form) and the local tensor's backward sums the gradient over the TP group instead.
"""

from __future__ import annotations

import torch
from torch import nn

from ...distributed.dtensor import is_dtensor
from ...internals.accelerate_internals import prepare_one
from ...internals import transformers_features, transformers_tp
from . import run_state
from .local_shards import install_local_shards


def replicate_plain_parameters(model: nn.Module, tp_mesh) -> dict:
    """Wrap every non-DTensor parameter as a ``Replicate`` DTensor on ``tp_mesh``; {old param: new param}."""
    from torch.distributed.tensor import DTensor, Replicate

    mapping = {}
    for module in model.modules():
        names = [n for n, p in module._parameters.items() if p is not None and not is_dtensor(p)]
        if not names:
            continue
        for name in names:
            old = module._parameters[name]
            if old in mapping:  # tied parameter: same new object everywhere
                module._parameters[name] = mapping[old]
                continue
            local = DTensor.from_local(old.data, tp_mesh, [Replicate()], run_check=False)
            new = nn.Parameter(local, requires_grad=old.requires_grad)
            module._parameters[name] = new
            mapping[old] = new
        run_state.module_record(module).tp_mesh = tp_mesh  # its TP mode (None: replicated) stays as noted
        # transformers' gradient all-reduce hook needs a leaf and a plain gradient: that sum is done here instead
        summed = transformers_tp.remove_grad_allreduce(module)
        install_local_shards(module, names, tp_mesh, sum_grads=summed)
    return mapping


def check_grad_allreduce(model: nn.Module) -> None:
    """Before anything is wrapped: the ``replicated_with_grad_allreduce`` modules of ``model`` need that style's
    install to be one this package takes over — its source hashes to a tested transformers release's — else this
    prepare is refused naming them (internals/transformers_features.py). Where the install changed, a module may
    carry the style in a form nobody knows: a model transformers' TP sharded (``_is_hooked`` modules) whose plan names
    the style counts as using it."""
    users = [name for name, module in model.named_modules() if transformers_tp.has_grad_allreduce(module)]
    if not users and any(getattr(m, "_is_hooked", False) for m in model.modules()):
        users = sorted(p for p, style in transformers_tp.plan_styles(model).items()
                       if style == "replicated_with_grad_allreduce")
    if users:
        transformers_features.require("grad_allreduce", users)


def remap_optimizer(optimizer, mapping: dict) -> None:
    """Point ``optimizer`` at the new Parameter objects (by identity; stock matched data pointers)."""
    optimizer = getattr(optimizer, "optimizer", optimizer)  # AcceleratedOptimizer
    for group in optimizer.param_groups:
        group["params"] = [mapping.get(p, p) for p in group["params"]]
    for old, new in mapping.items():
        if old in optimizer.state:
            optimizer.state[new] = optimizer.state.pop(old)


HEAD_FIELDS = ("num_attention_heads", "num_key_value_heads")


def check_heads_divisible(model, tp_size: int) -> None:
    """Tensor parallelism splits attention heads (and KV heads) across the TP ranks: a ``tp_size`` that does not
    divide them fails at the first forward with a bare ``shape '[2, 32, -1, 32]' is invalid``. Raised here, at
    ``prepare``, with the config fields, their values and ``tp_size`` instead. Models without such fields pass."""
    import math

    if not tp_size or tp_size <= 1:
        return
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        try:
            config = config.get_text_config()
        except Exception:  # noqa: BLE001  (a config whose text part cannot be resolved: check the top level)
            pass
    if config is None:
        return
    values = {f: getattr(config, f, None) for f in HEAD_FIELDS}
    values = {f: v for f, v in values.items() if isinstance(v, int) and not isinstance(v, bool) and v > 0}
    bad = {f: v for f, v in values.items() if v % tp_size}
    if not bad:
        return
    g = math.gcd(*values.values())
    fits = [d for d in range(1, g + 1) if g % d == 0]
    have = ", ".join(f"{f}={v}" for f, v in values.items())
    why = "; ".join(f"{f}={v} is not a multiple of tp_size={tp_size} ({v} % {tp_size} = {v % tp_size})"
                    for f, v in bad.items())
    raise ValueError(
        f"accel_fp8_fix: tensor parallelism splits the attention heads across tp_size={tp_size} ranks, but "
        f"{type(config).__name__} has {have}: {why}. Set ParallelismConfig(tp_size=...) (accelerate config "
        f"`parallelism_config_tp_size`) to a divisor of every head count ({', '.join(map(str, fits))}), or use a "
        f"model whose {' and '.join(bad)} is a multiple of {tp_size}")


def prepare_tp(wrapped, instance, args, kwargs):
    """``Accelerator._prepare_tp``: same passes as stock, then this package's Replicate wrapping (no
    ``ReplicateParallel``) when FSDP2 is on or when the TE prepare of this package runs. First, every model's
    head counts are checked against ``tp_size`` (:func:`check_heads_divisible`)."""
    pc = getattr(instance, "parallelism_config", None)
    for obj in args:
        if isinstance(obj, nn.Module):
            check_heads_divisible(obj, getattr(pc, "tp_size", 1) or 1)
    if not (instance.is_fsdp2 or run_state.inside_prepare(instance)):
        return wrapped(*args, **kwargs)
    result = [prepare_one(instance, obj, first_pass=True) if not isinstance(obj, nn.Module) else obj for obj in args]
    result = [prepare_one(instance, obj) if not isinstance(obj, nn.Module) else obj for obj in result]
    models = [obj for obj in result if isinstance(obj, nn.Module)]
    if not models:
        return result  # a dataloader (or optimizer) alone — the Trainer prepares its dataloader first: as stock
    if not any(is_dtensor(p) for m in models for p in m.parameters()):
        raise ValueError(
            "accel_fp8_fix: ParallelismConfig has tp_size > 1 but no parameter of the model is a DTensor: shard the "
            "model with tensor parallelism first (transformers `tp_plan`, or torch `parallelize_module` on "
            "accelerator.torch_device_mesh['tp'])"
        )
    tp_mesh = instance.torch_device_mesh["tp"]
    for model in models:
        check_grad_allreduce(model)
    for model in models:
        mapping = replicate_plain_parameters(model, tp_mesh)
        for obj in result:
            if isinstance(obj, torch.optim.Optimizer):
                remap_optimizer(obj, mapping)
    return result
