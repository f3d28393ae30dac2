"""TE kernels take local tensors: during a TE module's forward its DTensor parameters are swapped for their
(autograd-connected) local shards, then put back — outside forward the model stays DTensor-native
(optimizer, ``clip_grad_norm_``, DCP). Used for TE-native TP (te_convert) and for the parameters TP left
plain, made ``Replicate`` DTensors (tp).

``sum_grads``: the module sees only this rank's part of a TP-sharded activation (Qwen3's per-head
``q_norm``), so each rank's gradient of its replicated parameter is partial: the local tensor passes
through an identity whose backward all-reduces (sums) the gradient over the TP group — what transformers'
``replicated_with_grad_allreduce`` style does with a hook that needs a leaf parameter.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ...distributed import collectives
from ...distributed.dtensor import is_dtensor


class _SumGradOverGroup(torch.autograd.Function):
    """Identity forward; backward all-reduces (sums) the gradient over ``group`` (named explicitly), through the
    package's collectives."""

    @staticmethod
    def forward(ctx, tensor, group, name):
        ctx.group, ctx.name = group, name
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        collectives.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group, name=ctx.name)
        return grad, None, None


class _LocalShardsDuringForward:
    """Forward pre/post hooks: TE kernels take local tensors, so DTensor params are swapped for their
    (autograd-connected) local shards for the duration of the forward, then put back. One per module: it holds the
    parameters it took out (``saved``) until its post hook puts them back."""

    def __init__(self, names, tp_mesh, sum_grads=False):
        self.names = names
        self.tp_dims = tp_mesh.mesh_dim_names
        self.sum_group = tp_mesh.get_group() if sum_grads else None
        self.saved: dict = {}

    def pre(self, module, args):
        saved = {}
        for name in self.names:
            param = module._parameters.get(name)
            if param is None or not is_dtensor(param):
                continue  # plain: FSDP2 already handed in its unsharded tensor
            if param.device_mesh.mesh_dim_names != self.tp_dims:
                raise RuntimeError(
                    f"accel_fp8_fix: {type(module).__name__}.{name} reached forward sharded on mesh dims "
                    f"{param.device_mesh.mesh_dim_names} {param.placements}, not only on the TP mesh {self.tp_dims}: "
                    "FSDP2 did not unshard it (is the module outside every fully_shard unit?)"
                )
            saved[name] = param
            local = param.to_local()
            if self.sum_group is not None and local.requires_grad:
                local = _SumGradOverGroup.apply(local, self.sum_group, f"{type(module).__name__}.{name} gradient")
            module._parameters[name] = local
        self.saved = saved

    def post(self, module, args, output):
        saved, self.saved = self.saved, {}
        for name, param in saved.items():
            module._parameters[name] = param


def install_local_shards(module: nn.Module, names, tp_mesh, sum_grads: bool = False) -> None:
    hooks = _LocalShardsDuringForward(tuple(names), tp_mesh, sum_grads)
    module.register_forward_pre_hook(hooks.pre)
    module.register_forward_hook(hooks.post, always_call=True)
