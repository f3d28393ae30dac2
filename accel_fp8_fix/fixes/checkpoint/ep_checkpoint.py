"""MoE experts' FP8 state through sharded checkpoints, expert parallelism or not (issue 30 item 1).

Under transformers' expert parallelism the TE runners of an experts module (``te_gate_up`` / ``te_down``,
fixes/convert/moe_experts.py) hold the FP8 state of *this EP rank's* experts: GEMM *i* is global expert
``ep_rank × local + i``. Their ``_extra_state`` is a plain tensor, which DCP takes for a replicated value and
writes from one rank only — every EP rank would load that rank's experts' scales (measured: after ``load_state``
half the runners held another expert's state). Inside ``save_state`` / ``load_state`` the runners'
``_extra_state`` is therefore replaced, in the model's ``state_dict``, by their delayed-scaling tensors as DTensors
on the experts' own mesh — ``Shard`` on ``ep`` along the tensor axis (each rank's block is exactly its experts'
tensors, GEMM-major), ``Replicate`` on the other dims (the ranks holding the same experts hold the same state).
DCP writes each expert's state once and loads it in place into the live tensors; the load then hands TE its own
``_extra_state`` back. Without EP (experts FSDP2- or TP-sharded, their state the same on every rank) the same keys
carry ``Replicate`` DTensors of every expert's state, so a checkpoint loads across EP sizes (EP 2 -> no EP -> EP 2):
DCP reshards the per-expert blocks. Recipes without delayed-scaling tensors keep their ``_extra_state``. Outside
the two calls nothing changes (exports leave FP8 state out anyway).
"""

from __future__ import annotations

import contextlib

from ...distributed.dtensor import is_dtensor
from ...distributed.mesh_facts import EP_DIM, dim_names
from ...internals.accelerate_internals import prepared_models
from ...internals.transformer_engine import delayed_scaling_tensors
from ..convert.fp8_state import amax_group_of
from ..convert.moe_experts import RUNNERS, is_converted

# {prefix}_accel_fp8_fix_ep_fp8_{runner}_{fwd|bwd}_{amax_history|scale}: an attribute of the experts module while
# the context is open (torch's distributed state_dict resolves every key to an attribute)
KEY = "_accel_fp8_fix_ep_fp8"
EXTRA_STATE = "_extra_state"


def _key(runner: str, name: str) -> str:
    return f"{KEY}_{runner}_{name.replace('.', '_')}"


def _sharded_experts(model) -> list:
    """Converted experts modules on a device mesh (expert-parallel or FSDP2 / TP-sharded)."""
    return [m for m in model.modules() if is_converted(m) and is_dtensor(getattr(m, "gate_up_proj", None))]


def _as_dtensors(experts, runner) -> dict:
    """The runner's delayed-scaling tensors as DTensors on the experts' mesh: sharded on ``ep`` by expert under
    expert parallelism (the ranks' blocks in EP order are the global experts in order), else replicated."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = experts.gate_up_proj.device_mesh
    names = dim_names(mesh)
    expert_parallel = EP_DIM in names and amax_group_of(experts, None) is not None
    ep_dim = names.index(EP_DIM) if expert_parallel else None
    ep = mesh.size(ep_dim) if expert_parallel else 1
    out = {}
    for name, local in delayed_scaling_tensors(runner).items():
        axis = local.dim() - 1  # history [len, tensors], scale [tensors]: the tensor axis is the last
        placements = [Shard(axis) if i == ep_dim else Replicate() for i in range(mesh.ndim)]
        shape = (*local.shape[:-1], local.shape[-1] * ep)
        stride = (shape[-1], 1) if len(shape) == 2 else (1,)
        out[name] = DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)
    return out


def _save_hook(module, state_dict, prefix, local_metadata) -> None:
    for name in RUNNERS:
        tensors = _as_dtensors(module, getattr(module, name))
        if not tensors:  # no delayed-scaling state (other recipes): TE's own _extra_state, as saved
            continue
        state_dict.pop(f"{prefix}{name}.{EXTRA_STATE}", None)
        for key, tensor in tensors.items():
            state_dict[f"{prefix}{_key(name, key)}"] = tensor


def _load_pre_hook(module, state_dict, prefix, *args) -> None:
    """DCP has loaded the DTensor entries in place into the live tensors: drop them and give TE its own state."""
    for name in RUNNERS:
        runner = getattr(module, name)
        found = [state_dict.pop(f"{prefix}{_key(name, key)}", None) for key in delayed_scaling_tensors(runner)]
        if found and any(t is not None for t in found):
            state_dict[f"{prefix}{name}.{EXTRA_STATE}"] = runner.get_extra_state()


def _expose(experts) -> list:
    """The runners' tensors as attributes of the experts module under their state-dict names; their names."""
    names = []
    for name in RUNNERS:
        for key, tensor in delayed_scaling_tensors(getattr(experts, name)).items():
            object.__setattr__(experts, _key(name, key), tensor)
            names.append(_key(name, key))
    return names


@contextlib.contextmanager
def expert_parallel_fp8_state(accelerator):
    """Inside ``save_state`` / ``load_state``: every prepared model's sharded experts describe their runners' FP8
    state to DCP per expert (see the module docstring); nothing changes outside."""
    handles, exposed = [], []
    try:
        for model in prepared_models(accelerator):
            for experts in _sharded_experts(model):
                exposed.append((experts, _expose(experts)))
                handles.append(experts.register_state_dict_post_hook(_save_hook))
                handles.append(experts._register_load_state_dict_pre_hook(_load_pre_hook, with_module=True))
        yield
    finally:
        for handle in handles:
            handle.remove()
        for experts, names in exposed:
            for name in names:
                experts.__dict__.pop(name, None)
