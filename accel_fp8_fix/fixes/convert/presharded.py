"""Models transformers sharded at load (A18): ``from_pretrained(..., distributed_config=DistributedConfig(
tp_size=T, fsdp_size=F))`` — the supported N-D loading of transformers 5.x, where transformers applies TP *and*
FSDP2 itself on a mesh of its own (``fsdp`` x ``tp``). (The older ``tp_plan="auto", device_mesh=mesh`` that
accelerate's N-D example passes builds a world-size TP mesh and ignores ``device_mesh``.)

Stock ``_prepare_fsdp2`` leaves an FSDP2 model as it is (``fsdp2_prepare_model`` returns early) but first
resolves the FSDP plugin's auto-wrap policy on it, and by then the layer classes are FSDP subclasses
(``FSDPLlamaDecoderLayer``): ``ValueError: Could not find the transformer layer class LlamaDecoderLayer``, in
bf16 as in FP8. Here the policy is not resolved for such a model (stock would not use it), and the patched
prepare checks that the model's mesh matches the ParallelismConfig before converting to TE on its shards.
"""

from __future__ import annotations

import logging

from torch import nn

from ..._log import say, warn_user
from ...internals import torch_fsdp2
from ...distributed.dtensor import is_dtensor
from ...distributed.mesh_facts import FSDP_DIM_NAMES, TP_DIM, dim_names

logger = logging.getLogger(__name__)


def is_presharded(model: nn.Module) -> bool:
    """The model's root is already FSDP2-wrapped (``fully_shard`` ran before ``prepare``)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule) or isinstance(getattr(model, "_orig_mod", None), FSDPModule)


def set_auto_wrap_policy(wrapped, instance, args, kwargs):
    """``FullyShardedDataParallelPlugin.set_auto_wrap_policy``: not for a model FSDP2 already wraps."""
    model = args[0] if args else kwargs.get("model")
    if model is None or not is_presharded(model):
        return wrapped(*args, **kwargs)
    warn_if_mixed_precision_is_lost(instance, model)
    say(logger, logging.INFO,
        f"accel_fp8_fix: {type(model).__name__} is already FSDP2-sharded (transformers' DistributedConfig, or "
        "fully_shard before prepare): accelerate keeps its sharding, so the FSDP plugin's auto-wrap policy, mixed "
        "precision policy, reshard_after_forward and CPU offload do not apply to it")
    return None


def warn_if_mixed_precision_is_lost(plugin, model: nn.Module) -> None:
    """accelerate casts an FSDP2 model to its ``mixed_precision`` only through the ``MixedPrecisionPolicy`` it passes
    to ``fully_shard`` (no autocast on the FSDP2 path). A model FSDP2 already wraps keeps the policy it was sharded
    with: without one (transformers' ``DistributedConfig(fsdp_mixed_precision=False)``, its default) a bf16 or FP8
    run computes everything outside TE's FP8 GEMMs in fp32, silently. Said once, by name."""
    import torch

    asked = getattr(plugin, "mixed_precision_policy", None)
    if getattr(asked, "param_dtype", None) in (None, torch.float32):
        return
    if torch_fsdp2.param_dtypes(model) != {None}:
        return
    warn_user(
        f"accel_fp8_fix: {type(model).__name__} was sharded before prepare (transformers' DistributedConfig, or "
        f"fully_shard) without a mixed-precision policy, so accelerate's mixed precision ({asked.param_dtype}) does "
        "not reach it: it trains in fp32 outside TE's FP8 GEMMs. Load it with "
        "DistributedConfig(..., fsdp_mixed_precision=True) (bf16 parameters, fp32 gradient reduction), or pass "
        "fully_shard(mp_policy=...) yourself.")


def check_mesh_matches(accelerator, model: nn.Module) -> None:
    """A model sharded before ``prepare`` must be sharded as the ParallelismConfig says: a 'tp' dim (or an
    unnamed 1-D TP mesh) of ``tp_size`` ranks and, when FSDP2 was applied at load, an FSDP dim of
    ``dp_shard_size`` (x ``cp_size``) ranks; a clear error naming the parameter and both sizes otherwise."""
    pc = getattr(accelerator, "parallelism_config", None)
    if pc is None:
        return
    want = {TP_DIM: pc.tp_size}
    if is_presharded(model):
        want.update({n: pc.dp_shard_size * pc.cp_size for n in FSDP_DIM_NAMES})
    for name, param in model.named_parameters():
        if not is_dtensor(param):
            continue
        mesh = param.device_mesh
        names = dim_names(mesh)
        sizes = dict(zip(names, mesh.shape)) if names else {TP_DIM: mesh.size()}
        wrong = {n: (have, want[n]) for n, have in sizes.items() if n in want and have != want[n]}
        if wrong:
            got = ", ".join(f"'{n}' has {have} ranks (ParallelismConfig: {w})" for n, (have, w) in wrong.items())
            raise ValueError(
                f"accel_fp8_fix: {name} was sharded before prepare on mesh {names} {tuple(mesh.shape)}: {got}. Load "
                f"the model with the sizes of the accelerate config, e.g. DistributedConfig(tp_size={pc.tp_size}, "
                f"fsdp_size={pc.dp_shard_size * pc.cp_size}), or change parallelism_config to match")
