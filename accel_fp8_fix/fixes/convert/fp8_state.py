"""FP8 metadata: created at prepare time, registered on its module, identical on every rank (A7).

TE keeps scales and amax histories in ``module.fp8_meta``, a plain dict that ``.to()``, ``named_buffers()``
and state-dict audits never see. :func:`register_tensor_state` (the "unifier") finds tensor-valued state
that is neither a parameter nor a buffer and registers it as non-persistent buffers (TE's
``_extra_state`` already persists it). A forward pre-hook keeps the two views linked: if the module
moved its buffers (``.to()``, ``_apply``) the FP8 state follows them, and if TE replaced a tensor the
buffer follows TE; FP8 state always stays float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ...distributed.collectives import all_reduce, broadcast
from ...internals.transformer_engine import rebuild_quantizers
from .run_state import module_record, module_record_of

SKIP_ATTRS = {"_parameters", "_buffers", "_modules", "_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
              "_state_dict_hooks", "_load_state_dict_pre_hooks", "_non_persistent_buffers_set"}


@dataclass
class RegisteredState:
    module: str  # qualified module name
    path: tuple  # attribute path inside the module, e.g. ("fp8_meta", "scaling_fwd", "scale")
    buffer: str  # buffer name on the module
    shape: tuple
    dtype: torch.dtype


def _is_composable_state(obj) -> bool:
    """FSDP2's (or replicate's) per-module state, e.g. TE's ``_te_cached_parent_fsdp_state``: it holds the
    parameters of a whole FSDP unit, none of them this module's own state."""
    from ...internals.torch_internals import is_composable_state

    return is_composable_state(obj)


def _walk(obj, path, depth, seen, out):
    if isinstance(obj, torch.Tensor):
        if not isinstance(obj, nn.Parameter):
            out.append((path, obj))
        return
    if depth == 0 or id(obj) in seen or _is_composable_state(obj):
        return
    seen.add(id(obj))
    if isinstance(obj, dict):
        items = [(k, v) for k, v in obj.items() if isinstance(k, str)]
    elif isinstance(obj, (list, tuple)):
        items = list(enumerate(obj))
    elif hasattr(obj, "__dict__") and not isinstance(obj, (nn.Module, type)) and not callable(obj):
        items = list(vars(obj).items())
    else:
        return
    for key, value in items:
        _walk(value, path + (key,), depth - 1, seen, out)


def find_unregistered_tensors(module: nn.Module, attrs=None, depth: int = 4) -> list:
    """(attribute path, tensor) for tensors held by ``module`` (not its children) outside params/buffers,
    looking in the attributes named by ``attrs`` (default: all of them)."""
    known = {id(t) for t in module._parameters.values() if t is not None}
    known |= {id(t) for t in module._buffers.values() if t is not None}
    found = []
    for name, value in vars(module).items():
        if name in SKIP_ATTRS or name.startswith("_accel_fp8_fix") or (attrs is not None and name not in attrs):
            continue
        _walk(value, (name,), depth, set(), found)
    return [(path, t) for path, t in found if id(t) not in known]


def _get(root, path):
    for key in path:
        root = root[key] if isinstance(root, (dict, list, tuple)) else getattr(root, key)
    return root


def _set(root, path, value):
    parent = _get(root, path[:-1])
    if isinstance(parent, (dict, list)):
        parent[path[-1]] = value
    else:
        setattr(parent, path[-1], value)


def _buffer_name(path) -> str:
    return "_fp8_" + "__".join(str(p) for p in path)


class _StateLink:
    """Keeps registered buffers and the module's own references (fp8_meta) pointing at one tensor. A forward
    pre-hook of its module, found there again (:func:`state_link_of`): it follows the module through
    ``copy.deepcopy``, its entries' tensors copied with the module's."""

    def __init__(self, entries):
        self.entries = entries  # list of [path, buffer name, dtype, linked tensor]

    def __call__(self, module, args=None):
        changed = False
        for entry in self.entries:
            path, name, dtype, linked = entry
            try:
                own = _get(vars(module), path)
            except (KeyError, AttributeError, IndexError):
                continue  # TE dropped that state (e.g. recipe changed); the buffer stays as it was
            buffer = module._buffers.get(name)
            if buffer is not linked:  # the module moved/cast its buffers: FP8 state follows, kept in fp32
                fresh = buffer.to(dtype) if buffer.dtype != dtype else buffer
                _set(vars(module), path, fresh)
                module._buffers[name] = fresh
                entry[3] = fresh
                changed = True
            elif own is not linked:  # TE replaced its tensor: the buffer follows
                module._buffers[name] = own
                entry[3] = own
        if changed:
            rebuild_quantizers(module)


def register_tensor_state(model: nn.Module, modules=None, attrs=None) -> list[RegisteredState]:
    """Register each unregistered tensor on ``modules`` (default: every module), found in ``attrs``
    (default: every attribute; TE modules: ``("fp8_meta",)``), as a non-persistent buffer.

    Returns what was found and registered. Idempotent: already-registered state is not found again.
    """
    names = {m: n for n, m in model.named_modules()}
    registered = []
    for module in modules if modules is not None else model.modules():
        entries = []
        for path, tensor in find_unregistered_tensors(module, attrs):
            name = _buffer_name(path)
            if name in module._buffers:
                continue
            module.register_buffer(name, tensor, persistent=False)
            entries.append([path, name, tensor.dtype, tensor])
            registered.append(RegisteredState(names.get(module, "?"), path, name, tuple(tensor.shape), tensor.dtype))
        if entries:
            link = state_link_of(module)
            if link is None:
                link = _StateLink([])
                module.register_forward_pre_hook(link)
            link.entries.extend(entries)
    return registered


def state_link_of(module: nn.Module):
    """The :class:`_StateLink` among ``module``'s forward pre-hooks, or None: its FP8 state is not registered."""
    return next((hook for hook in module._forward_pre_hooks.values() if isinstance(hook, _StateLink)), None)


def share_state_over(module: nn.Module, group) -> None:
    """``module``'s FP8 state is shared by other ranks than the model's amax group's: ``group`` (the TE runners of an
    expert-parallel experts module: the ranks holding the same experts, fixes/convert/moe_experts.py)."""
    module_record(module).amax_group = group


def amax_group_of(module: nn.Module, default):
    """The group ``module``'s FP8 state is shared over: its own (:func:`share_state_over`) or ``default``."""
    own = module_record_of(module).amax_group
    return default if own is None else own


def fp8_state_tensors(model: nn.Module, group=None, default=None) -> dict:
    """{qualified buffer name: tensor} of every registered FP8 state tensor, in a rank-independent order; with
    ``group``: only the modules whose FP8 state is shared over it (``default``: the model's group)."""
    out = {}
    for name, module in model.named_modules():
        link = state_link_of(module)
        if link is None or (group is not None and amax_group_of(module, default) is not group):
            continue
        link(module)  # make sure the buffers are the live tensors
        for path, buffer, _, _ in link.entries:
            out[f"{name}.{buffer}" if name else buffer] = module._buffers[buffer]
    return out


def state_groups(model: nn.Module, default) -> list:
    """The groups the model's FP8 state is shared over: ``default`` first, then each module's own group in module
    order (one per rank and role: every rank lists its own, in the same order)."""
    groups = [default]
    for module in model.modules():
        own = amax_group_of(module, None)
        if own is not None and state_link_of(module) is not None and \
                all(own is not g for g in groups):
            groups.append(own)
    return groups


@torch.no_grad()
def broadcast_fp8_state(model: nn.Module, group, src: int = 0) -> int:
    """Copy rank ``src``'s FP8 state into every rank's, in place, on the explicit ``group``; bytes sent. State
    shared over another group (expert-parallel experts) is broadcast on that group from its first rank."""
    import torch.distributed as dist

    sent = 0
    for shared in state_groups(model, group):
        first = src if shared is group else dist.get_process_group_ranks(shared)[0]
        for name, tensor in fp8_state_tensors(model, shared, group).items():
            broadcast(tensor, src=first, group=shared, name=name)
            sent += tensor.numel() * tensor.element_size()
    return sent


@torch.no_grad()
def reduce_pending_amax(model: nn.Module, group) -> int:
    """MAX-reduce row 0 of every amax history on ``group`` (one collective per group the state is shared over:
    expert-parallel experts' on their own); returns the values reduced.

    Row 0 is the current step's amax, still rank-local until TE's next reduction takes its max over the
    group (TP shards differ; under FSDP2 TE's backward writes the weight amax there). Reducing it early is
    idempotent for training and makes every rank hold the same state, so a checkpoint — whichever rank's
    copy the writer keeps — resumes exactly as the uninterrupted run continues.
    """
    import torch.distributed as dist

    reduced = 0
    for shared in state_groups(model, group):
        tensors = fp8_state_tensors(model, shared, group)
        rows = [t[0] for name, t in sorted(tensors.items()) if name.endswith("amax_history")]
        if not rows:
            continue
        flat = torch.cat([r.reshape(-1).float() for r in rows])
        all_reduce(flat, op=dist.ReduceOp.MAX, group=shared, name="pending amax (row 0 of the amax histories)")
        offset = 0
        for row in rows:
            row.copy_(flat[offset:offset + row.numel()].reshape(row.shape))
            offset += row.numel()
        reduced += flat.numel()
    return reduced
