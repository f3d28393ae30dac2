"""TE kernels take local tensors: during a TE module's forward its DTensor parameters are swapped for their
(autograd-connected) local shards, then put back — outside forward the model stays DTensor-native
(optimizer, ``clip_grad_norm_``, DCP). Used for TE-native TP (te_convert) and for the parameters TP left
plain, made ``Replicate`` DTensors (tp)."""

from __future__ import annotations

from torch import nn

from ..distributed.collectives import is_dtensor


class _LocalShardsDuringForward:
    """Forward pre/post hooks: TE kernels take local tensors, so DTensor params are swapped for their
    (autograd-connected) local shards for the duration of the forward, then put back."""

    def __init__(self, names, tp_mesh):
        self.names = names
        self.tp_dims = tp_mesh.mesh_dim_names

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
            module._parameters[name] = param.to_local()
        module._accel_fp8_fix_saved_params = saved

    def post(self, module, args, output):
        for name, param in getattr(module, "_accel_fp8_fix_saved_params", {}).items():
            module._parameters[name] = param
        module._accel_fp8_fix_saved_params = {}


def install_local_shards(module: nn.Module, names, tp_mesh) -> None:
    hooks = _LocalShardsDuringForward(tuple(names), tp_mesh)
    module.register_forward_pre_hook(hooks.pre)
    module.register_forward_hook(hooks.post, always_call=True)
