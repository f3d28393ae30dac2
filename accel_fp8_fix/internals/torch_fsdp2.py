"""FSDP2 internals: which module a sharded parameter is (un)registered on.

FSDP2 swaps each parameter between its sharded and unsharded form with ``setattr`` on the module it
recorded at ``fully_shard`` time (``FSDPParam._module_info``: ``module``, ``shared_modules``), reached from
the unit's state (``FSDPModule._get_fsdp_state()._fsdp_param_group.fsdp_params``). Converting a module to
Transformer Engine after sharding must move that record to the new module.
"""

from __future__ import annotations


# (file under torch/distributed/fsdp/_fully_shard/, text that must be in it): read, not imported — importing
# FSDP2 costs ~1 s, which `import accelerate` must not pay for a check.
_SOURCES = (
    ("_fully_shard.py", "def _get_fsdp_state("),
    ("_fsdp_state.py", "_fsdp_param_group"),
    ("_fsdp_param.py", "class ParamModuleInfo"),
    ("_fsdp_param.py", "self._module_info"),
    ("_fsdp_param.py", "shared_modules"),
)
# What only the opt-in FP8 all-gather uses (FSDP2's all-gather extension, fixes/all_gather/fp8_all_gather.py): checked at
# prepare when the switch is on, so a torch without them refuses the switch by name, not the whole patch set.
FP8_ALL_GATHER_SOURCES = (
    ("_fsdp_param.py", "def _init_extensions("),
    ("_fsdp_param.py", '"fsdp_pre_all_gather"'),
    ("_fsdp_param.py", "def _sharded_local_tensor("),
    ("_fsdp_param.py", "self.all_gather_outputs"),
    ("_fsdp_param.py", "post_forward_mesh_info"),
    ("_fsdp_param.py", "offload_to_cpu"),
    ("_fsdp_param.py", "def reset_sharded_param("),
    ("_fsdp_param.py", "self.padded_sharded_param_size"),
    ("_fsdp_param_group.py", "fsdp_param.reset_sharded_param()"),
    ("_fsdp_common.py", "self.shard_mesh_size"),
    # the scales are computed in a forward pre-hook of the root placed before FSDP2's own, which runs its lazy
    # init first (it may replace shards) and, on a user's post-optimizer event, extends that event
    ("_fsdp_state.py", "def _lazy_init("),
    ("_fsdp_state.py", "if self._is_root is not None:"),
    ("_fsdp_state.py", "post_optim_event"),
    ("_fsdp_state.py", "self._pre_forward, prepend=True"),
    # one shard rank: FSDP2 copies only the first all-gather input (the block scale grid rides in the metadata)
    ("_fsdp_param_group.py", "all_gather_input = fsdp_param.all_gather_inputs[0]"),
)


# Functions the fixes rely on the behaviour of, hashed per release of the window (``block_sha256``: their source
# text, read not imported; ``python scripts/source_hashes.py`` prints them for a torch source tree or wheel). A
# text check above says an internal is still mentioned; these say it is unchanged — an untested torch
# (ACCEL_FP8_FIX_ALLOW_UNTESTED) is refused by name when one of them hashes to none of the releases'.
_UNCHANGED = "8a9c0beb265e7a3a"
HASHED = {  # te_convert moves a parameter's module record; FSDP2 swaps parameters through it
    ("_fsdp_param.py", "FSDPParam._setattr_on_modules"): {
        "2.11.0": _UNCHANGED, "2.12.1": _UNCHANGED, "2.13.0": _UNCHANGED, "2.14.1": _UNCHANGED, "2.15.0": _UNCHANGED},
}
FP8_ALL_GATHER_HASHED = {  # fixes/all_gather/fp8_all_gather.py re-runs _init_extensions' set-up and relies on the rest
    ("_fsdp_param.py", "FSDPParam._init_extensions"): {
        "2.11.0": "7acdd637b487951c", "2.12.1": "7acdd637b487951c", "2.13.0": "7acdd637b487951c",
        "2.14.1": "7acdd637b487951c", "2.15.0": "7bf883bb18abd559"},
    ("_fsdp_param.py", "FSDPParam.reset_sharded_param"): {
        "2.11.0": "f911cdb84d020fc3", "2.12.1": "f911cdb84d020fc3", "2.13.0": "f911cdb84d020fc3",
        "2.14.1": "f911cdb84d020fc3", "2.15.0": "953ad7b1e15dec46"},
    ("_fsdp_param.py", "FSDPParam.all_gather_inputs"): {
        "2.11.0": "a552b84d46bd9443", "2.12.1": "b5729d12141f80e2", "2.13.0": "b5729d12141f80e2",
        "2.14.1": "b5729d12141f80e2", "2.15.0": "b5729d12141f80e2"},
    ("_fsdp_param_group.py", "FSDPParamGroup.wait_for_unshard"): {  # the world-size-1 shortcut
        "2.11.0": "92c196c60683a329", "2.12.1": "92c196c60683a329", "2.13.0": "6a15ab87f2f3a2ab",
        "2.14.1": "6a15ab87f2f3a2ab", "2.15.0": "fda580862090cb5f"},
    ("_fsdp_state.py", "FSDPState._lazy_init"): {
        "2.11.0": "fda7452a5ed72ee1", "2.12.1": "7e3dd80ccd33573a", "2.13.0": "7e3dd80ccd33573a",
        "2.14.1": "7e3dd80ccd33573a", "2.15.0": "03d126039c230efa"},
}
FSDP2_FOLDER = "distributed/fsdp/_fully_shard"


def _checked(versions, sources, hashed) -> list[str]:
    from . import changed_blocks, check_sources, package_root

    problems = check_sources("torch", versions, sources, FSDP2_FOLDER)
    root = package_root("torch")
    if root is not None and not problems:
        problems = changed_blocks(root / FSDP2_FOLDER, hashed, f"torch {versions.get('torch')}")
    return problems


def check(versions) -> list[str]:
    return _checked(versions, _SOURCES, HASHED)


def fp8_all_gather_missing(versions) -> list[str]:
    """What the FP8 all-gather needs of the installed torch's FSDP2 and is not there or changed (empty: all
    there, unchanged)."""
    return _checked(versions, FP8_ALL_GATHER_SOURCES, FP8_ALL_GATHER_HASHED)


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


def param_dtypes(model) -> set:
    """The ``MixedPrecisionPolicy.param_dtype`` of every FSDP2 unit inside ``model`` (``None``: no cast, the
    parameters' own dtype)."""
    from torch.distributed.fsdp import FSDPModule

    return {module._get_fsdp_state()._mp_policy.param_dtype for module in model.modules()
            if isinstance(module, FSDPModule)}


def retarget(fsdp_params_, old, new) -> None:
    """FSDP2 re-registers (un)sharded params with setattr on the recorded module: record ``new`` instead."""
    for fsdp_param in fsdp_params_:
        info = fsdp_param._module_info
        if info.module is old:
            info.module = new
        info.shared_modules = [new if m is old else m for m in info.shared_modules]


# -- the all-gather extension (fixes/all_gather/fp8_all_gather.py) ----------------------------------------------------------
# FSDP2 calls ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` on a parameter's sharded local tensor when that
# tensor's class has them (``FSDPParam._init_extensions``, re-run by the group's ``lazy_init``). Conversion to TE
# happens after ``fully_shard``, so the extension is installed on an already-sharded parameter: its local tensor
# is swapped for an alias of another class, and ``_init_extensions`` re-run, as FSDP2 would have at construction.


def param_name(fsdp_param) -> str:
    return fsdp_param._module_info.param_name


def owner_module(fsdp_param):
    return fsdp_param._module_info.module


def padded_shard_size(fsdp_param):
    return fsdp_param.padded_sharded_param_size


def shard_world_size(fsdp_param) -> int:
    """How many ranks FSDP2 shards this parameter over (its mesh's shard dimension)."""
    return fsdp_param.mesh_info.shard_mesh_size


def shard_rank(fsdp_param) -> int:
    """This rank's index among the ranks FSDP2 shards this parameter over."""
    return fsdp_param.mesh_info.shard_mesh_rank


def sharded_param(fsdp_param):
    """The sharded DTensor parameter (what the optimizer steps)."""
    return fsdp_param.sharded_param


def sharded_local_tensor(fsdp_param):
    return fsdp_param._sharded_local_tensor


def why_no_extension(fsdp_param) -> str | None:
    """Why FSDP2 could not run an all-gather extension on this parameter (None: it can)."""
    if fsdp_param.offload_to_cpu:
        return "CPU offload (FSDP2 copies the offloaded shard to the device as a plain tensor)"
    if fsdp_param.post_forward_mesh_info not in (None, fsdp_param.mesh_info):  # True: the same mesh; False: None
        return "reshard_after_forward=<int> (FSDP2 re-gathers from a smaller mesh without the extension)"
    if fsdp_param.fsdp_placement.dim != 0:
        return f"sharding on dim {fsdp_param.fsdp_placement.dim} (a shard_placement_fn)"
    if getattr(fsdp_param, "_unsharded_param", None) is not None:
        return "it was already all-gathered once (a forward ran before prepare finished)"
    return None


def install_extension(fsdp_param, alias) -> None:
    """Make ``alias(local)`` (an alias of the sharded local tensor, of a class with the extension hooks) the tensor
    FSDP2 gathers from, and re-run what FSDP2 does at construction for an extension. FSDP2 may replace the local
    tensor later — ``reset_sharded_param`` at its lazy init (e.g. when a loader replaced the shard's storage after
    ``fully_shard``: transformers' ``DistributedConfig`` loading) or after ``model.to()`` — so this parameter's
    ``reset_sharded_param`` re-applies the alias after FSDP2's own.

    What FSDP2 keeps per extension, torch 2.11-2.15 (``FSDPParam._init_extensions``, re-run here at install and
    at every re-install, as FSDP2's own group ``lazy_init`` does after ``reset_sharded_param``): a fresh
    ``_extensions_data`` (the metadata between the two hooks) and ``_unsharded_inner_tensors = []`` (the tensors
    ``fsdp_post_all_gather`` returned, freed and re-allocated with the unsharded parameter: here the all-gather
    outputs themselves, which FSDP2 frees anyway, so a re-install after a gather loses nothing); torch 2.15 also
    sets ``_release_all_gather_outputs_after_post_all_gather`` from the class's
    ``fsdp_should_release_all_gather_outputs_after_post_all_gather`` (ours: False, stated). ``all_gather_outputs``
    is emptied once, at install (FSDP2 sizes it at the first gather from the inputs' numels and dtypes: uint8
    now), never at a re-install (the unsharded parameter may view it)."""
    cls = None

    def apply():
        nonlocal cls
        local = fsdp_param.sharded_param._local_tensor
        if cls is None or type(local) is not cls:
            local = alias(local)
            cls = type(local)
            fsdp_param.sharded_param._local_tensor = local
        fsdp_param._init_extensions()

    original = type(fsdp_param).reset_sharded_param

    def reset_sharded_param():
        original(fsdp_param)
        apply()

    fsdp_param.reset_sharded_param = reset_sharded_param
    fsdp_param.all_gather_outputs = []
    apply()


def lazy_init(model) -> None:
    """FSDP2's lazy init of the root ``model`` (what its root pre-forward does first; a no-op once done): it
    decides the root and may replace local shards (``reset_sharded_param``)."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model._get_fsdp_state()._lazy_init()


def extend_post_optim_event(model) -> None:
    """When the user gave FSDP2 a post-optimizer event (``FSDPModule.set_post_optim_event``), its root waits its
    all-gather streams on that event instead of on the whole default stream: record it again after the work just
    enqueued (the weight scales), so the all-gathers' copy-in reads them finished. A no-op otherwise (and on CPU)."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        event = model._get_fsdp_state()._state_ctx.post_optim_event
        if event is not None:
            event.record()


def local_of_unsharded(param):
    """The local tensor of an unsharded parameter: under FSDP2 x TP FSDP2 wraps what ``fsdp_post_all_gather``
    returned in a DTensor on the TP mesh (``_from_local_no_grad``), and hands that DTensor back as ``out=``."""
    local = getattr(param, "_local_tensor", None)
    return param if local is None else local


def plain_ops_class_attribute():
    """``torch._C._disabled_torch_function_impl``: set as ``__torch_function__`` of a Tensor subclass, every op on
    an instance returns a plain ``torch.Tensor`` (how ``nn.Parameter`` stays out of results)."""
    import torch

    return torch._C._disabled_torch_function_impl


def version_of(tensor) -> int:
    """A tensor's version counter (bumped by every in-place op on it or an alias)."""
    return tensor._version
