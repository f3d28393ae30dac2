"""FSDP2 internals: which module a sharded parameter is (un)registered on.

FSDP2 swaps each parameter between its sharded and unsharded form with ``setattr`` on the module it
recorded at ``fully_shard`` time (``FSDPParam._module_info``: ``module``, ``shared_modules``), reached from
the unit's state (``FSDPModule._get_fsdp_state()._fsdp_param_group.fsdp_params``). Converting a module to
Transformer Engine after sharding must move that record to the new module.
"""

from __future__ import annotations


def _version() -> str:
    from ..engine.versions import installed_version

    return f"torch {installed_version('torch')}"


def check() -> list[str]:
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam, ParamModuleInfo
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    except ImportError as exc:
        return [f"{_version()}: FSDP2 internals not importable ({exc})"]
    problems = []
    if not hasattr(FSDPModule, "_get_fsdp_state"):
        problems.append(f"{_version()}: FSDPModule._get_fsdp_state is gone")
    fields = set(getattr(ParamModuleInfo, "__dataclass_fields__", {}))
    if not {"module", "shared_modules"} <= fields:
        problems.append(f"{_version()}: ParamModuleInfo has fields {sorted(fields)}, not module / shared_modules")
    import inspect

    if "_module_info" not in inspect.getsource(FSDPParam.__init__):
        problems.append(f"{_version()}: FSDPParam no longer records _module_info")
    if "_fsdp_param_group" not in inspect.getsource(FSDPState):
        problems.append(f"{_version()}: FSDPState has no _fsdp_param_group")
    return problems


def fsdp_params(model) -> list:
    """Every ``FSDPParam`` of the FSDP2 units inside ``model``."""
    from torch.distributed.fsdp import FSDPModule

    params = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            if group is not None:
                params.extend(group.fsdp_params)
    return params


def retarget(fsdp_params_, old, new) -> None:
    """FSDP2 re-registers (un)sharded params with setattr on the recorded module: record ``new`` instead."""
    for fsdp_param in fsdp_params_:
        info = fsdp_param._module_info
        if info.module is old:
            info.module = new
        info.shared_modules = [new if m is old else m for m in info.shared_modules]
