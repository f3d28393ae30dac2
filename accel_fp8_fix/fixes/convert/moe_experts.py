"""MoE experts packed as 3-D parameters run their GEMMs in FP8 through Transformer Engine's ``GroupedLinear``.

transformers 5.x stores a MoE layer's experts as two 3-D parameters (``@use_experts_implementation`` classes:
Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, DeepSeek-V3 ...): ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``,
and loops over the experts a batch hits with ``F.linear(x, gate_up_proj[e])``. After sharding, each supported
experts module gets a forward that

- keeps the user's Parameters exactly (names, shapes, dtype, FSDP2 / HSDP / TP sharding, DCP): state_dict keys
  and checkpoints are plain transformers' plus the FP8 ``_extra_state`` of two parameter-less TE modules
  (``te_gate_up``, ``te_down``), left out of exports like every TE module's (fixes/checkpoint/checkpoint.py);
- sorts the (token, expert) pairs by expert (within an expert: by top-k slot, then token — transformers' order),
  counts the rows per expert (``m_splits``, zeros allowed) and, under FP8, pads each expert's rows to the FP8 row
  multiple (TE's ``get_align_size_for_quantization``: 16, 32 for MXFP8, 128 for NVFP4) with zero rows, unpadded
  after each GEMM;
- runs both expert GEMMs as one ``te.GroupedLinear(num_gemms=E)`` each, on per-expert views of the (unsharded)
  3-D parameter: ``gate_up_proj[e]`` is ``[2I, H]`` = TE's ``[out, in]``; the views are handed to TE for the
  call only (internals/transformer_engine/modules.py), so autograd returns each expert's weight gradient to the 3-D
  Parameter FSDP2 / TP own;
- applies the class's own gating (``_apply_gate``: ``act(gate) * up``), the routing weights and the
  ``index_add_`` of transformers' loop, under the model's TE autocast (same recipe and amax group).

GPT-OSS's layout (``is_transposed=True, has_bias=True``: ``gate_up_proj [E, H, 2I]``, ``down_proj [E, I, H]``,
``*_bias [E, out]``, gate and up interleaved in the output columns, a clamped SwiGLU): each expert's weight is
handed to TE as ``[out, in]`` *contiguous* (``transpose(1, 2).contiguous()`` inside autograd: TE's GEMMs read
storage, not strides — a strided view would be silently wrong on a GPU in a non-FP8 pass), the biases as
``GroupedLinear``'s per-GEMM biases (TE adds them in the GEMM epilogue; under FP8 TE casts them to bf16, as its
own ``GroupedLinear`` does), and the output columns keep transformers' order, so the class's own ``_apply_gate``
(interleaved ``::2`` / ``1::2``, ``clamp``, ``alpha``, ``up + 1``) runs unchanged.

TP (``moe_tp_experts`` with ``packed_colwise`` gate_up / ``rowwise`` down) keeps transformers' own input and
output transforms: the forward here is what transformers' TP forward calls, on the local shards it hands in
(each rank: its ``I / tp`` slice of every expert, outputs summed by the style). Experts a TP plan leaves alone —
transformers 5.25's default Qwen3-MoE / Mixtral plans — are replicated on the TP ranks (``Replicate`` on ``tp``,
fixes/convert/tp.py): every TP rank runs every expert whole on the same tokens, their gradients alike on every TP rank.
Refused by name (kept in high precision, in the conversion report): non-gated experts, a post-expert norm,
TP-sharded transposed experts, a TP layout other than the ones above, an expert-parallel dispatch this package does
not know, local dims that are not a multiple of the recipe's.

Why GroupedLinear on views (and not E ``te.Linear`` or a new parameter layout): one grouped GEMM per
projection with ``num_gemms=E`` FP8 metadata is what TE's MoE path (Megatron-core ``TEGroupedLinear``) runs;
owning the weights would change the parameters FSDP2 / TP / DCP see.
"""

from __future__ import annotations

import logging
from types import MethodType

import torch
from torch import nn

from ...distributed.dtensor import is_dtensor
from ...distributed.mesh_facts import DATA_PARALLEL_DIMS, EP_DIM, TP_DIM, dim_names, is_fsdp_placement
from ...internals import torch_internals, transformers_ep, transformers_tp
from ...internals import transformer_engine as te_internals
from .fp8_shapes import FP8_LAST_MULTIPLE, recipe_multiples
from .fp8_state import amax_group_of, share_state_over
from .run_state import module_record, module_record_of

logger = logging.getLogger(__name__)

RUNNERS = ("te_gate_up", "te_down")


def is_packed_experts(module: nn.Module) -> bool:
    """A module holding MoE experts as 3-D parameters (any: supported or not)."""
    return any(p.dim() == 3 for p in module.parameters(recurse=False))


def is_converted(module: nn.Module) -> bool:
    """Its GEMMs run in TE (this package converted it)."""
    return module_record_of(module).te_experts


def _expert_parallel(module) -> bool:
    return bool(getattr(module, "_is_expert_parallel", False))


def _shape_reason(module) -> str | None:
    if _expert_parallel(module):
        reason = transformers_ep.unsupported(module)
        if reason is not None:
            return reason
    if not hasattr(module, "has_gate"):
        return "not a transformers @use_experts_implementation experts class"
    unsupported = [what for what, flag in (("no gate (up_proj only)", not getattr(module, "has_gate", True)),
                                           ("a post-expert norm", getattr(module, "has_post_expert_norm", False)))
                   if flag]
    if unsupported:
        return f"experts with {', '.join(unsupported)}: not supported by this package's grouped-GEMM forward yet"
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == down.dim() == 3):
        return "expects 3-D gate_up_proj and down_proj"
    experts = getattr(module, "num_experts", None)
    if _expert_parallel(module):  # transformers set num_experts to this rank's count; the parameters are global
        ep = _ep_size(module)
        experts = experts * ep if isinstance(experts, int) and ep else None
    (_, two_i, hidden), (_, down_out, down_in) = _out_in(module, gate_up), _out_in(module, down)
    layout = "[E, in, out]" if _transposed(module) else "[E, out, in]"
    if experts != gate_up.shape[0] or experts != down.shape[0] or two_i != 2 * down_in or down_out != hidden:
        return (f"gate_up_proj {list(gate_up.shape)} / down_proj {list(down.shape)} do not match num_experts={experts}"
                f" and the {layout} layout of a gated MLP")
    if getattr(module, "has_bias", False):
        for name, out in (("gate_up_proj_bias", two_i), ("down_proj_bias", hidden)):
            bias = getattr(module, name, None)
            if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (experts, out):
                return f"expects {name} [E, out] = {[experts, out]}, found {getattr(bias, 'shape', None)}"
    return None


def _transposed(module) -> bool:
    return bool(getattr(module, "is_transposed", False))


def _out_in(module, weight) -> tuple[int, int, int]:
    """(E, out, in) of an experts weight in either layout."""
    experts, first, second = weight.shape
    return (experts, second, first) if _transposed(module) else (experts, first, second)


def _biases(module) -> tuple | None:
    return (module.gate_up_proj_bias, module.down_proj_bias) if getattr(module, "has_bias", False) else None


def _tp_dims(param):
    """([(mesh dim name, placement, size)] of a DTensor parameter's TP dims, [...] of its data-parallel dims). A dim
    is data-parallel when named so, or — unnamed or named otherwise, but not 'tp' — when it carries FSDP's own
    placement (Shard(0) / Replicate): accelerate's plain FSDP2 mesh has no dim names."""
    if not is_dtensor(param):
        return [], None
    mesh = param.device_mesh
    names = tuple(mesh.mesh_dim_names or (f"dim{i}" for i in range(mesh.ndim)))
    tp, other = [], []
    for i, (dim, placement) in enumerate(zip(names, param.placements)):
        data_parallel = dim in DATA_PARALLEL_DIMS or (dim != TP_DIM and is_fsdp_placement(placement))
        (other if data_parallel else tp).append((dim, placement, mesh.size(i)))
    return tp, other


def _ep_size(module) -> int | None:
    """The size of the ``ep`` dim of the experts' parameters' mesh (None when they are not on one)."""
    param = getattr(module, "gate_up_proj", None)
    if not is_dtensor(param):
        return None
    names = dim_names(param.device_mesh)
    return param.device_mesh.size(names.index(EP_DIM)) if EP_DIM in names else None


def _ep_layout_reason(module) -> str | None:
    """Why the expert-parallel parameters' layout cannot run here: each must be ``Shard(0)`` on ``ep`` (whole
    experts per rank) and FSDP's placements on every other dim of the expert mesh."""
    for name in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
        param = getattr(module, name, None)
        if param is None or not isinstance(param, torch.Tensor):
            continue
        if not is_dtensor(param):
            return f"{name} is not a DTensor under expert parallelism"
        names = dim_names(param.device_mesh)
        if EP_DIM not in names:
            return f"{name} lives on mesh dims {names}, without transformers' {EP_DIM!r} dim"
        for dim, placement in zip(names, param.placements):
            ok = (placement.is_shard() and getattr(placement, "dim", None) == 0) if dim == EP_DIM else (
                is_fsdp_placement(placement))
            if not ok:
                return (f"{name} has placement {placement} on mesh dim {dim!r}; expert parallelism runs here with "
                        "Shard(0) on 'ep' and FSDP's Shard(0) / Replicate on the other dims")
    return None


def expert_replica_group(module):
    """The process group of the ranks that hold this expert-parallel module's experts (every dim of the experts'
    mesh but ``ep``: transformers' ``efsdp``, with ``dp_replicate`` under HSDP): the ranks whose FP8 state for
    expert *i* of this rank is that same expert's. None when the module is not expert-parallel."""
    param = getattr(module, "gate_up_proj", None)
    if not (_expert_parallel(module) and is_dtensor(param)):
        return None
    mesh = param.device_mesh
    others = tuple(n for n in mesh.mesh_dim_names if n != EP_DIM)
    if len(others) == 1:
        return mesh[others[0]].get_group()
    return torch_internals.flatten_mesh(mesh[others]).get_group()


def _tp_size(module) -> tuple[int, str | None]:
    """(TP degree of the experts' parameters, why their layout cannot run here — None when it can)."""
    if _expert_parallel(module):
        return 1, _ep_layout_reason(module)
    sizes = []
    if _transposed(module) or _biases(module) is not None:
        for name in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
            tp, other = _tp_dims(getattr(module, name, None))
            placed = [(dim, placement) for dim, placement, size in tp + (other or [])
                      if size > 1 and not is_fsdp_placement(placement)]
            if placed:
                return 1, (f"{name} has placement {placed[0][1]} on mesh dim {placed[0][0]!r}: TP-sharded experts "
                           "with [E, in, out] weights or biases (GPT-OSS's layout) are not supported; only FSDP's "
                           "Shard(0) or Replicate")
        return 1, None
    for name, want in (("gate_up_proj", "packed"), ("down_proj", "row")):
        tp, other = _tp_dims(getattr(module, name))
        for dim, placement, _ in other or ():
            if not is_fsdp_placement(placement):
                return 1, f"{name} has placement {placement} on mesh dim {dim!r}; only FSDP's Shard(0) or Replicate"
        tp = [t for t in tp if t[2] > 1 and not t[1].is_replicate()]  # replicated on TP: every rank runs it whole
        if not tp:
            sizes.append(1)
            continue
        if len(tp) > 1:
            return 1, f"{name} is sharded on several TP-like mesh dims {[t[0] for t in tp]}"
        dim, placement, size = tp[0]
        ok = (torch_internals.is_strided_shard(placement) and placement.dim == 1
              and getattr(placement, "split_factor", None) == 2) if want == "packed" else (
            placement.is_shard() and not torch_internals.is_strided_shard(placement) and placement.dim in (2, -1))
        if not ok:
            return 1, (f"{name} has placement {placement} on mesh dim {dim!r}; supported: transformers' packed_colwise "
                       "gate_up_proj (_StridedShard(dim=1, sf=2)) and rowwise down_proj (Shard(2))")
        sizes.append(size)
    if len(set(sizes)) > 1:
        return 1, f"gate_up_proj and down_proj are TP-sharded over different degrees {sizes}"
    if sizes[0] > 1:
        style = transformers_tp.tp_style(module)
        if style is None or type(style).__name__ != transformers_tp.EXPERTS_STYLE:
            return 1, (f"TP-sharded experts need transformers' moe_tp_experts style ({transformers_tp.EXPERTS_STYLE}) "
                       f"on the experts module, found {type(style).__name__ if style is not None else 'none'}")
    return sizes[0], None


def _local_experts(module) -> int:
    """Experts this rank runs: transformers' ``num_experts`` (the local count under EP), else the 3-D dim 0."""
    return module.num_experts if _expert_parallel(module) else module.gate_up_proj.shape[0]


def _refusal(module, dim_multiple: int) -> tuple[int, str | None]:
    """(TP degree, why this experts module stays in high precision — None when it converts)."""
    reason = _shape_reason(module)
    if reason is not None:
        return 1, reason
    tp_size, reason = _tp_size(module)
    if reason is not None:
        return 1, reason
    experts, two_i, hidden = _out_in(module, module.gate_up_proj)
    dims = {"2*I / tp (gate_up out)": two_i // tp_size, "H": hidden, "I / tp (down in)": (two_i // 2) // tp_size}
    bad = {k: v for k, v in dims.items() if v % dim_multiple}
    if bad or two_i % (2 * tp_size):
        return tp_size, (f"expert GEMM dims on this rank {dims}: TE's FP8 GEMMs need multiples of {dim_multiple}")
    missing = te_internals.grouped_views_missing()
    if missing:
        return tp_size, f"the installed Transformer Engine's GroupedLinear cannot run on views: {'; '.join(missing)}"
    return tp_size, None


def _fp8_row_multiple() -> int | None:
    """The rows each expert's GEMM input must be a multiple of under the current FP8 recipe; None when FP8 is off."""
    manager = te_internals.fp8_global_state()
    if not manager.is_fp8_enabled():
        return None
    return expert_row_multiple(manager.get_fp8_recipe())


def expert_row_multiple(recipe) -> int:
    """Rows each expert is padded to under ``recipe``: TE's own alignment where TE says it (NVFP4: 128), else the
    recipe's GEMM token multiple (at least 16)."""
    align = te_internals.align_size_for_quantization(recipe)
    return align if align is not None else max(FP8_LAST_MULTIPLE, recipe_multiples(recipe)[0])


def _routing(top_k_index, num_experts: int, align: int | None, expert_parallel: bool = False):
    """Rows sorted by expert: (token of each row, top-k slot of each row, m_splits, padded row of each row or
    None, padded rows in all). Under expert parallelism a route to another rank's expert carries the sentinel
    ``num_experts`` (transformers' ``AllReduceEP``, weight 0): it is left out, as transformers' loop skips it."""
    tokens = top_k_index.shape[0]
    flat = top_k_index.t().reshape(-1)  # (slot, token) order, as transformers' torch.where(expert_mask[e])
    pair = torch.arange(flat.numel(), device=flat.device)
    if expert_parallel:
        keep = flat < num_experts
        flat, pair = flat[keep], pair[keep]
    if flat.numel() and int(flat.max()) >= num_experts:
        raise RuntimeError(f"accel_fp8_fix: expert index {int(flat.max())} >= num_experts={num_experts} (an EP "
                           "sentinel on a module that is not expert-parallel?)")
    expert_of_row, order = torch.sort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    order = pair[order]
    token, slot = order % tokens, order // tokens
    if align is None:
        return token, slot, counts.cpu(), None, int(flat.numel())
    padded = (counts + align - 1) // align * align
    start = torch.cumsum(counts, 0) - counts
    start_padded = torch.cumsum(padded, 0) - padded
    rows = torch.arange(flat.numel(), device=flat.device)
    dest = start_padded[expert_of_row] + rows - start[expert_of_row]
    return token, slot, padded.cpu(), dest, int(padded.sum())


def _expert_weights(weight, transposed: bool):
    """The experts' weights as TE takes them, one ``[out, in]`` tensor per expert: views of ``[E, out, in]``;
    ``[E, in, out]`` transposed contiguous (TE reads storage, not strides); under the FP8 all-gather
    (fixes/all_gather/fp8_experts_gather.py) one ``Float8Tensor`` per expert built from the gathered bytes."""
    from_gathered = getattr(weight, "expert_weights", None)
    if from_gathered is not None:
        return from_gathered(transposed)
    return (weight.transpose(1, 2).contiguous() if transposed else weight).unbind(0)


def _grouped(runner, weights, bias, x, splits, dest, total):
    """One grouped GEMM of ``x`` (rows sorted by expert) with the experts' ``weights`` (``[out, in]`` each) and
    ``bias [E, out]``."""
    if dest is not None:
        x = x.new_zeros(total, x.shape[-1]).index_copy(0, dest, x)
    biases = bias.unbind(0) if bias is not None else None
    y = te_internals.grouped_linear_on_views(runner, weights, x, splits, biases)
    return y.index_select(0, dest) if dest is not None else y


def te_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers' experts forward (``hidden_states [T, H]``, ``top_k_index`` / ``top_k_weights [T, k]`` ->
    ``[T, H]``) with both expert GEMMs as TE grouped GEMMs on views of the experts' 3-D parameters."""
    gate_up, down = self.gate_up_proj, self.down_proj
    if is_dtensor(gate_up) or is_dtensor(down):
        raise RuntimeError(
            f"accel_fp8_fix: {type(self).__name__} reached its FP8 forward with DTensor parameters "
            f"({getattr(gate_up, 'placements', None)}): FSDP2 did not unshard them, or transformers' TP style did "
            "not hand in local shards")
    gate_up, down = _expert_weights(gate_up, _transposed(self)), _expert_weights(down, _transposed(self))
    gate_up_bias, down_bias = _biases(self) or (None, None)
    with torch.no_grad():
        token, slot, splits, dest, total = _routing(top_k_index, self.num_experts, _fp8_row_multiple(),
                                                    _expert_parallel(self))
    with _expert_autocast(self):
        hidden = _grouped(self.te_gate_up, gate_up, gate_up_bias, hidden_states[token], splits, dest, total)
        hidden = self._apply_gate(hidden)
        out = _grouped(self.te_down, down, down_bias, hidden, splits, dest, total)
    out = out * top_k_weights[token, slot, None]
    final = torch.zeros_like(hidden_states)
    final.index_add_(0, token, out.to(final.dtype))
    return final


def _expert_autocast(module):
    """Under expert parallelism, TE's autocast again with the same recipe but the experts' replica group: TE keys
    its amax buffers by (recipe, group), so the runners' delayed-scaling amaxes are max-reduced over the ranks that
    hold the same experts — position *i* of a runner is a different global expert on each EP rank — while every
    other module keeps the model's group. A nested autocast reduces nothing itself (TE reduces every key at the
    outermost exit, each on its own group). Elsewhere, or with FP8 off: nothing."""
    import contextlib

    group = amax_group_of(module, None)
    manager = te_internals.fp8_global_state()
    if group is None or not manager.is_fp8_enabled():
        return contextlib.nullcontext()
    import transformer_engine.pytorch as te

    from .fp8_autocast import te_autocast

    return te_autocast(te)(True, manager.get_fp8_recipe(), group)


def _install(te, module, tp_size: int) -> None:
    _, two_i, hidden = _out_in(module, module.gate_up_proj)
    experts = _local_experts(module)
    dtype = module.gate_up_proj.dtype
    local_i = two_i // 2 // tp_size
    bias = _biases(module) is not None
    gate_up = te_internals.grouped_linear_without_weights(te, experts, hidden, 2 * local_i, dtype, bias=bias)
    down = te_internals.grouped_linear_without_weights(te, experts, local_i, hidden, dtype, bias=bias)
    for name, runner in zip(RUNNERS, (gate_up, down)):
        runner.train(module.training)
        module.add_module(name, runner)
    forward = MethodType(te_experts_forward, module)
    if _expert_parallel(module):
        group = expert_replica_group(module)
        for target in (module, gate_up, down):
            share_state_over(target, group)
        transformers_ep.replace_experts_forward(module, forward)
    elif not transformers_tp.replace_original_forward(module, forward):
        module.forward = forward
    module_record(module).te_experts = True


def convert_experts(model: nn.Module, te, dim_multiple: int = FP8_LAST_MULTIPLE, exclude=()) -> tuple[list, list]:
    """Give every supported packed-experts module of ``model`` the FP8 grouped-GEMM forward; (converted names,
    [(name, reason)] kept in high precision)."""
    converted, skipped = [], []
    for name, module in model.named_modules():
        if name in exclude or not is_packed_experts(module) or is_converted(module):
            continue
        tp_size, reason = _refusal(module, dim_multiple)
        if reason is not None:
            skipped.append((name, reason))
            continue
        _install(te, module, tp_size)
        converted.append(name)
    return converted, skipped
