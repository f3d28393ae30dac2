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


# (file under torch/distributed/fsdp/_fully_shard/, text that must be in it): read, not imported — importing
# FSDP2 costs ~1 s, which `import accelerate` must not pay for a check.
_SOURCES = (
    ("_fully_shard.py", "def _get_fsdp_state("),
    ("_fsdp_state.py", "_fsdp_param_group"),
    ("_fsdp_param.py", "class ParamModuleInfo"),
    ("_fsdp_param.py", "self._module_info"),
    ("_fsdp_param.py", "shared_modules"),
)


def check() -> list[str]:
    from . import missing_from_sources, package_root

    root = package_root("torch")
    if root is None:
        return [f"{_version()}: torch not found"]
    return missing_from_sources(root / "distributed" / "fsdp" / "_fully_shard", _SOURCES, _version())


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
