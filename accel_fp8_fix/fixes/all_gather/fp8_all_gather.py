"""FP8 all-gather under FSDP2 (opt-in: ``fp8_config: {all_gather: fp8}`` / ``ACCELERATE_FP8_ALL_GATHER=fp8`` /
``te_recipe_kwargs(..., all_gather="fp8")``).

Without it FSDP2 all-gathers every weight in the policy's ``param_dtype`` (2 bytes a parameter with bf16, 4 with
fp32) and TE quantizes the gathered weight again for its GEMM. With it, every weight of a TE ``Linear`` this package
converted is quantized *before* the all-gather, on its shard: FSDP2 gathers 1 byte a parameter and the TE module
receives TE's own ``Float8Tensor`` (gathered bytes + the weight's ``scale_inv``), which TE's GEMM uses as it is
(TE's ``QuantizedTensor`` weight path: no second quantization). The same mechanism as torchao's
``enable_fsdp_float8_all_gather``: FSDP2's all-gather extension hooks (``fsdp_pre_all_gather`` /
``fsdp_post_all_gather``) on the class of the parameter's sharded local tensor.

Drop-in: the parameters (DTensors), the optimizer, the gradients and every checkpoint stay in the master dtype —
the local shard is an *alias* of the same storage whose class adds the two hooks and pickles as a plain tensor.

Scales: per-tensor current scaling of each whole weight. The local amaxes of every converted weight are packed
into one vector and MAX-reduced on the mesh's amax group in **one** all-reduce per weight update, issued ONCE PER
STEP OUTSIDE FSDP2's hooks — in a forward pre-hook of the prepared model that runs before FSDP2's root pre-forward
(before any unshard) — through the package's collectives (fixes/all_gather/fp8_weight_record.py: the record of the converted
weights and their shards' stamps, which every optimizer step, load and shard replacement moves). Each rank then
quantizes its shard with the scale of the whole weight (under FSDP2 x TP: the same on every rank of a TP group);
the hooks only read buffers allocated once. The scale follows TE's ``compute_scale_from_amax`` (epsilon and
power-of-2 options of the current-scaling recipe; the delayed recipe's ``margin``): under the delayed recipe the
*weights* are current-scaled (activations and gradients keep delayed scaling). Under Float8 block scaling each
128x128 tile has its own scale: with every shard boundary on a tile boundary and every shard whole (checked;
refused by name otherwise) the shard is quantized tile by tile and gathered with its scale grid — no amax exchange
at all; over one shard rank (FSDP2 gathers nothing, copying only the first tensor) the grid rides in the metadata.
MXFP8 and NVFP4 are refused by name at ``prepare``.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field

import torch

from ..._log import say
from ...internals import torch_fsdp2
from ...internals import transformer_engine as te_internals
from . import fp8_experts_gather
from ..start.fp8_all_gather_policy import Fp8AllGatherError, refusal, requested  # noqa: F401 (re-exported)
from .fp8_weight_record import WeightRecord, WeightScales

logger = logging.getLogger(__name__)


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.as_subclass(torch.Tensor)


@dataclass
class _PerTensorGather:
    """One weight under per-tensor scaling (delayed / current recipes): FP8 bits + the whole weight's scale, read
    from :class:`WeightScales` (computed before the step's first unshard; nothing computed or allocated here but
    the all-gather input)."""
    scales: WeightScales
    index: int  # in ``scales``
    record_index: int  # in ``scales.record``
    padded_size: torch.Size
    name: str

    def pre_all_gather(self, local: torch.Tensor, orig_size):
        scales, i = self.scales, self.index
        scales.record.check_current(self.record_index)
        if local.numel():
            bits = te_internals.quantized_bits(scales.weight_quantizers[i](local.detach()))
            if bits.shape != self.padded_size:  # the last rank's short shard: zero rows (dropped after the gather)
                padded = torch.zeros(self.padded_size, dtype=torch.uint8, device=local.device)
                padded[: bits.shape[0]].copy_(bits)
                bits = padded
        else:
            bits = torch.zeros(self.padded_size, dtype=torch.uint8, device=local.device)
        return (bits,), (scales.scale_inv_views[i], tuple(orig_size))

    def post_all_gather(self, outputs, metadata, param_dtype, out):
        (gathered,) = outputs
        scale_inv, orig_size = metadata
        data = gathered[: orig_size[0]]  # uneven sharding: FSDP2 pads each shard's rows
        if out is not None:
            te_internals.refill_float8(torch_fsdp2.local_of_unsharded(out), data, scale_inv)
            return None
        # Row-wise bytes only. On Hopper dgrad needs the transposed bytes: TE derives them from these in backward
        # (``update_usage(columnwise_usage=True)``) and, for a module under FSDP2, drops them right after the dgrad
        # GEMM (``clear_columnwise_cache``), so they never outlive one module's backward. The tensor's own
        # ``scale_inv`` is allocated here, once, as a normal tensor even under inference_mode (an evaluation first);
        # later gathers copy into it (``refill_float8``).
        fp8_dtype = self.scales.params.fp8_dtype
        quantizer = self.scales.weight_quantizers[self.index]
        with torch.inference_mode(False):
            own_scale_inv = scale_inv.clone()
        return te_internals.make_float8(data, own_scale_inv, fp8_dtype, param_dtype, quantizer), (gathered,)


BLOCK = 128  # Float8BlockScaling's weight tile: 128 x 128


@dataclass
class _BlockGather:
    """One weight under Float8BlockScaling (128x128 tiles, one scale each): every tile lies inside one FSDP2 shard
    and every shard is whole (both checked at install), so quantizing each shard tile by tile IS quantizing the
    whole weight — no amax exchange at all. Over several shard ranks FSDP2 gathers the row-wise bytes and the
    shards' scale grids (the grids stack along rows like the data). Over ONE shard rank FSDP2 gathers nothing: its
    shortcut copies only the first tensor ``fsdp_pre_all_gather`` returns into its output buffer (torch 2.11-2.15
    ``FSDPParamGroup.wait_for_unshard``), so there the scale grid — already the whole weight's — rides in the
    metadata, which FSDP2 hands back unchanged on either path."""
    quantizer: object
    padded_size: torch.Size
    scale_shape: tuple  # of one shard: [rows / 128, roundup(ceil(cols / 128), 4)]
    name: str
    gather_scales: bool  # False over one shard rank: the scale grid goes in the metadata

    def pre_all_gather(self, local: torch.Tensor, orig_size):
        data, sinv = te_internals.block_rowwise(self.quantizer(local.detach()))  # TE's buffers as they are
        if data.shape != self.padded_size or tuple(sinv.shape) != self.scale_shape:  # excluded at install
            raise Fp8AllGatherError(f"accel_fp8_fix: FP8 all-gather of {self.name}: the shard quantized to "
                                    f"{tuple(data.shape)} / scales {tuple(sinv.shape)}, not {tuple(self.padded_size)} "
                                    f"/ {self.scale_shape}")
        if self.gather_scales:
            return (data, sinv), (tuple(orig_size), None)
        return (data,), (tuple(orig_size), sinv)

    def post_all_gather(self, outputs, metadata, param_dtype, out):
        orig_size, scale_inv = metadata
        gathered = outputs[0]
        if scale_inv is None:  # gathered with the data: every shard's grid, stacked along rows
            scale_inv = outputs[1]
        data, scale_inv = gathered[: orig_size[0]], scale_inv[: -(-orig_size[0] // BLOCK)]
        if out is not None:
            te_internals.refill_float8_blockwise(torch_fsdp2.local_of_unsharded(out), data, scale_inv)
            return None
        quantizer = self.quantizer.copy()
        return te_internals.make_float8_blockwise(data, scale_inv, param_dtype, quantizer), tuple(outputs)


class Fp8AllGatherShard(torch.Tensor):
    """The local shard of a converted weight as FSDP2 sees it: the same storage, plain for every op (results are
    plain tensors, pickling writes a plain tensor), plus FSDP2's all-gather extension hooks, which hand the work to
    its ``gather_state`` (the weight's per-tensor or block all-gather; set by :func:`_alias`)."""

    gather_state: object

    __torch_function__ = torch_fsdp2.plain_ops_class_attribute()

    def __reduce_ex__(self, protocol):
        return torch.Tensor.__reduce_ex__(_plain(self), protocol)

    def fsdp_pre_all_gather(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy):
        return self.gather_state.pre_all_gather(_plain(self), orig_size)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        return self.gather_state.post_all_gather(all_gather_outputs, metadata, param_dtype, out)

    def fsdp_should_release_all_gather_outputs_after_post_all_gather(self) -> bool:
        """torch >= 2.15 asks (``FSDPParam._init_extensions``); its default, stated: the FP8 tensor
        ``fsdp_post_all_gather`` builds is a view of the all-gather outputs, so FSDP2 must keep them until it
        reshards (releasing them would free the weight's bytes under TE's GEMM)."""
        return False


def _alias(local: torch.Tensor, state) -> "Fp8AllGatherShard":
    shard = local.as_subclass(Fp8AllGatherShard)
    shard.gather_state = state
    return shard


@dataclass
class Fp8AllGatherSetup:
    kind: str  # "per_tensor" (delayed / current recipes) or "block" (Float8BlockScaling)
    record: WeightRecord  # every weight gathered in FP8: its FSDP2 parameter and its shard's stamp
    scales: WeightScales | None  # per_tensor: the packed amax all-reduce; block: None (tile scales are local)
    weights: list = field(default_factory=list)  # qualified names of the weights gathered in FP8
    experts: list = field(default_factory=list)  # ... of them, the packed-experts weights (a scale per expert)
    kept: dict = field(default_factory=dict)  # experts weights left in the policy's dtype: name -> why
    hook: object = field(default=None, repr=False)  # the root forward pre-hook's handle

    @property
    def amax_reductions(self) -> int:
        """Weight-amax all-reduces so far (block scaling needs none)."""
        return self.scales.reductions if self.scales is not None else 0

    def weights_changed(self) -> None:
        """Say that weights changed in a way version counters do not see (``p.data.copy_(...)``): the next
        forward of the prepared model recomputes the scales."""
        self.record.invalidate()

    def before_forward(self, model) -> None:
        """The prepared (root) model's forward pre-hook, before FSDP2's: FSDP2's lazy init first (it may replace
        shards), then the step's scales — the one collective, issued here, on the default stream."""
        torch_fsdp2.lazy_init(model)
        if self.scales is not None and self.scales.refresh():
            torch_fsdp2.extend_post_optim_event(model)  # FSDP2's all-gather streams wait on our kernels too


def _before_forward(setup, module, args):
    setup.before_forward(module)


def _chosen_weights(model, te_modules) -> list:
    """(qualified name, FSDPParam) of the weight of every converted TE Linear FSDP2 shards."""
    import transformer_engine.pytorch as te

    names = {id(m): n for n, m in model.named_modules()}
    linears = {id(m) for m in te_modules if isinstance(m, te.Linear)}
    return [(f"{names.get(id(torch_fsdp2.owner_module(p)), '?')}.weight", p) for p in torch_fsdp2.fsdp_params(model)
            if id(torch_fsdp2.owner_module(p)) in linears and torch_fsdp2.param_name(p) == "weight"]


def _block_misaligned(name: str, fsdp_param) -> str | None:
    """Why this weight's shards cannot carry whole 128x128 tiles (None: they can)."""
    world = torch_fsdp2.shard_world_size(fsdp_param)
    rows = torch_fsdp2.padded_shard_size(fsdp_param)[0]
    full = torch_fsdp2.sharded_param(fsdp_param).shape[0]
    if world == 1:
        return None
    if rows % BLOCK:
        return (f"{name}: {full} rows sharded over {world} ranks is {rows} rows a shard, not a multiple of {BLOCK}, "
                "so 128x128 tiles would cross shard boundaries")
    if full != rows * world:  # FSDPParam.all_gather_inputs: on an uneven shard every input must be padded-size
        return (f"{name}: {full} rows sharded over {world} ranks is uneven (shards of {rows} rows, the last ones "
                f"shorter): FSDP2 requires every all-gather input of an unevenly sharded parameter to have the "
                f"padded shard's size, and the tile scales are a second input of another size")
    return None


def _problems(chosen, kind: str) -> list:
    problems = [f"{name}: {why}" for name, p in chosen if (why := torch_fsdp2.why_no_extension(p)) is not None]
    if kind == "block":
        problems += [why for name, p in chosen if (why := _block_misaligned(name, p)) is not None]
    return problems


def install(model, te_modules, recipe, group) -> Fp8AllGatherSetup:
    """Install the FP8 all-gather on the weight of every converted TE Linear of ``model`` (FSDP2-sharded); every
    weight is checked first, so a refusal leaves no weight half-switched. The recipe itself (its kind, its weight
    tiles) was checked once, before sharding, by the prepare's plan (fixes/convert/fp8_plan.py)."""
    kind = "block" if type(recipe).__name__ == "Float8BlockScaling" else "per_tensor"
    chosen = _chosen_weights(model, te_modules)
    problems = _problems(chosen, kind)
    if problems:
        raise Fp8AllGatherError("accel_fp8_fix: the FP8 all-gather cannot run on " + "; ".join(problems) + (
            ". Shard over fewer ranks, or remove the setting (ACCELERATE_FP8_ALL_GATHER / fp8_config all_gather)"
            if kind == "block" else ""))
    experts, kept = [], {}
    for name, module, fsdp_param in fp8_experts_gather.chosen_experts(model):
        why = fp8_experts_gather.why_kept(module, fsdp_param, kind)
        if why is None:
            experts.append((name, fsdp_param))
        else:
            kept[name] = why
    record = WeightRecord()
    scales = WeightScales(record, group, te_internals.scale_params(recipe)) if kind == "per_tensor" else None
    setup = Fp8AllGatherSetup(kind, record, scales, kept=kept)
    for name, fsdp_param in chosen:
        setup.weights.append(name)
        record_index = record.add(name, fsdp_param, kind)
        padded = torch_fsdp2.padded_shard_size(fsdp_param)
        if kind == "block":
            quantizer = te_internals.float8_block_weight_quantizer(recipe)
            state = _BlockGather(quantizer, padded, te_internals.block_scale_shape(quantizer, *padded), name,
                                 gather_scales=torch_fsdp2.shard_world_size(fsdp_param) > 1)
        else:
            state = _PerTensorGather(scales, scales.add(record_index), record_index, padded, name)
        torch_fsdp2.install_extension(fsdp_param, functools.partial(_alias, state=state))
    for name, fsdp_param in experts:  # per-tensor: a scale per expert, in the same packed all-reduce
        setup.weights.append(name)
        setup.experts.append(name)
        padded = torch_fsdp2.padded_shard_size(fsdp_param)
        if kind == "block":
            record.add(name, fsdp_param, kind)
            quantizer = te_internals.float8_block_weight_quantizer(recipe)
            state = fp8_experts_gather.ExpertsBlockGather(
                quantizer, padded, te_internals.block_scale_shape(quantizer, *padded[1:]), name,
                gather_scales=torch_fsdp2.shard_world_size(fsdp_param) > 1)
        else:
            record_index = record.add(name, fsdp_param, "per_expert")
            count = torch_fsdp2.sharded_param(fsdp_param).shape[0]
            state = fp8_experts_gather.ExpertsPerTensorGather(scales, scales.add(record_index, experts=count),
                                                              record_index, padded, name)
        torch_fsdp2.install_extension(fsdp_param, functools.partial(_alias, state=state))
    # before FSDP2's own root pre-forward hook (registered with prepend=True at fully_shard): before any unshard
    setup.hook = model.register_forward_pre_hook(functools.partial(_before_forward, setup), prepend=True)
    how = ("128x128 tile scales computed on each shard, no amax exchange" if kind == "block"
           else "scales from one packed amax all-reduce per weight update, before the step's first unshard")
    say(logger, logging.INFO, f"accel_fp8_fix: FP8 all-gather on {len(setup.weights)} weight(s) "
                              f"({len(setup.experts)} packed-experts, a scale per expert); {how}")
    if kept:
        say(logger, logging.WARNING, "accel_fp8_fix: FP8 all-gather leaves these experts weights in the policy's "
                                     "dtype: " + "; ".join(f"{n}: {why}" for n, why in kept.items()))
    return setup
