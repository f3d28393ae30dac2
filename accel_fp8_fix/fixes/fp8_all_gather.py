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
into one vector and MAX-reduced on the mesh's amax group in **one** all-reduce per weight update (the shards'
version counters tell when the optimizer — or a load — changed them), so each rank quantizes its shard with the
scale of the whole weight (under FSDP2 x TP: the same on every rank of a TP group). (An optimizer step bumps the
version counter of the DTensor parameter, a load into the local shard that of the shard: both are watched, and the
shard itself, which FSDP2 may replace.) The scale follows TE's
``compute_scale_from_amax`` (epsilon and power-of-2 options of the current-scaling recipe; the delayed recipe's
``margin``): under the delayed recipe the *weights* are current-scaled (activations and gradients keep delayed
scaling). Under Float8 block scaling each 128x128 tile has its own scale: with every shard boundary on a tile
boundary (checked; refused by name otherwise) the shard is quantized tile by tile and gathered with its scale grid
— no amax exchange at all. MXFP8 and NVFP4 are refused by name at ``prepare``.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field

import torch

from .._log import say
from ..internals import torch_fsdp2
from ..internals import transformer_engine as te_internals
from .fp8_all_gather_policy import Fp8AllGatherError, check_request, refusal, requested  # noqa: F401 (re-exported)

logger = logging.getLogger(__name__)

FLT_MAX = 3.4028234663852886e38


@dataclass
class _ScaleParams:
    fp8_dtype: object
    fp8_max: float
    margin: int = 0
    force_pow_2: bool = False
    epsilon: float = 0.0


def scale_params(recipe) -> _ScaleParams:
    """The weight-scale settings of ``recipe``: current scaling's ``fp8_quant_fwd_weight`` (power-of-2, epsilon),
    the delayed recipe's ``margin``."""
    fp8_dtype = te_internals.fp8_weight_dtype(recipe)
    params = _ScaleParams(fp8_dtype, te_internals.fp8_max(fp8_dtype))
    qparams = getattr(recipe, "fp8_quant_fwd_weight", None)
    if qparams is not None:
        params.force_pow_2 = bool(getattr(qparams, "power_2_scale", False))
        params.epsilon = float(getattr(qparams, "amax_epsilon", 0.0))
    if type(recipe).__name__ == "DelayedScaling":
        params.margin = int(getattr(recipe, "margin", 0))
    return params


def scales_from_amaxes(amax: torch.Tensor, params: _ScaleParams) -> torch.Tensor:
    """TE's ``compute_scale_from_amax`` (common/recipe/recipe_common.cuh) over a vector, fp32; a delayed recipe's
    ``margin`` divides by ``2**margin`` (exact: a power of two)."""
    amax = amax.float()
    amax = torch.where(amax < params.epsilon, torch.full_like(amax, params.epsilon), amax)
    scale = torch.full_like(amax, params.fp8_max) / amax
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, FLT_MAX), scale)
    if params.margin:
        scale = torch.ldexp(scale, torch.full_like(scale, -params.margin))
    bad = (amax == 0) | torch.isinf(amax) | torch.isnan(amax)
    scale = torch.where(bad, torch.ones_like(scale), scale)
    if params.force_pow_2:
        scale = (scale.view(torch.int32) & torch.tensor(0xFF800000 - (1 << 32), dtype=torch.int32)).view(torch.float32)
    return scale


class WeightScales:
    """The scale of every converted weight, from ONE packed amax all-reduce per weight update."""

    def __init__(self, group, params: _ScaleParams):
        self.group, self.params = group, params
        self.fsdp_params: list = []  # read at each refresh: FSDP2 may replace a parameter's local tensor
        self.versions = None
        self.scale = self.scale_inv = None
        self.reductions = 0  # packed amax all-reduces so far

    def add(self, fsdp_param) -> int:
        self.fsdp_params.append(fsdp_param)
        self.versions = None
        return len(self.fsdp_params) - 1

    def _shards(self) -> list:
        return [torch_fsdp2.sharded_local_tensor(p) for p in self.fsdp_params]

    def refresh(self) -> None:
        """Recompute the scales when any shard changed since the last time: the DTensor parameter's version counter
        (an optimizer step), the local shard's (a load into it) or the shard itself (FSDP2 replaced it)."""
        shards = self._shards()
        versions = tuple((id(t), torch_fsdp2.version_of(torch_fsdp2.sharded_param(p)), torch_fsdp2.version_of(t))
                         for p, t in zip(self.fsdp_params, shards))
        if versions == self.versions:
            return
        device = shards[0].device
        with torch.no_grad():
            amax = torch.stack([t.detach().abs().amax().float() if t.numel() else torch.zeros((), device=device)
                                for t in shards])
            if self.group is not None:
                import torch.distributed as dist

                dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.group)
            self.scale = scales_from_amaxes(amax, self.params)
            self.scale_inv = torch.reciprocal(self.scale)
        self.reductions += 1
        self.versions = versions


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.as_subclass(torch.Tensor)


@dataclass
class _PerTensorGather:
    """One weight under per-tensor scaling (delayed / current recipes): FP8 bits + the whole weight's scale."""
    scales: WeightScales
    index: int
    padded_size: torch.Size
    name: str

    def pre_all_gather(self, local: torch.Tensor, orig_size):
        scales, i = self.scales, self.index
        scales.refresh()
        bits = torch.zeros(self.padded_size, dtype=torch.uint8, device=local.device)
        if local.numel():
            quantizer = te_internals.float8_quantizer(scales.scale[i:i + 1].clone(), scales.params.fp8_dtype)
            quantized = te_internals.quantized_bits(quantizer(local.detach()))
            if quantized.shape == bits.shape:
                bits = quantized
            else:
                bits[: quantized.shape[0]].copy_(quantized)
        return (bits,), (scales.scale_inv[i:i + 1].clone(), tuple(orig_size))

    def post_all_gather(self, outputs, metadata, param_dtype, out):
        (gathered,) = outputs
        scale_inv, orig_size = metadata
        data = gathered[: orig_size[0]]  # uneven sharding: FSDP2 pads each shard's rows
        if out is not None:
            te_internals.refill_float8(torch_fsdp2.local_of_unsharded(out), data, scale_inv)
            return None
        # Row-wise bytes only. On Hopper dgrad needs the transposed bytes: TE derives them from these in backward
        # (``update_usage(columnwise_usage=True)``) and, for a module under FSDP2, drops them right after the dgrad
        # GEMM (``clear_columnwise_cache``), so they never outlive one module's backward.
        fp8_dtype = self.scales.params.fp8_dtype
        quantizer = te_internals.float8_quantizer(torch.reciprocal(scale_inv), fp8_dtype)
        return te_internals.make_float8(data, scale_inv, fp8_dtype, param_dtype, quantizer), (gathered,)


BLOCK = 128  # Float8BlockScaling's weight tile: 128 x 128


@dataclass
class _BlockGather:
    """One weight under Float8BlockScaling (128x128 tiles, one scale each): every tile lies inside one FSDP2 shard
    (checked at install), so quantizing each shard tile by tile IS quantizing the whole weight — no amax exchange
    at all. FSDP2 gathers the row-wise bytes and the shards' scale grids; the grids stack along rows like the data."""
    quantizer: object
    padded_size: torch.Size
    scale_shape: tuple  # of one padded shard: [padded rows / 128, roundup(ceil(cols / 128), 4)]
    name: str

    def pre_all_gather(self, local: torch.Tensor, orig_size):
        if local.numel():
            data, sinv = te_internals.block_rowwise(self.quantizer(local.detach()))
            if data.shape == self.padded_size and tuple(sinv.shape) == self.scale_shape:
                return (data, sinv), (tuple(orig_size),)  # a full shard: TE's buffers as they are, no copy
        bits = torch.zeros(self.padded_size, dtype=torch.uint8, device=local.device)
        scale_inv = torch.zeros(self.scale_shape, dtype=torch.float32, device=local.device)
        if local.numel():  # the last rank's short shard: padded with zero rows (dropped after the gather)
            bits[: data.shape[0]].copy_(data)
            scale_inv[: sinv.shape[0]].copy_(sinv)
        return (bits, scale_inv), (tuple(orig_size),)

    def post_all_gather(self, outputs, metadata, param_dtype, out):
        gathered, gathered_scale_inv = outputs
        (orig_size,) = metadata
        rows = orig_size[0]
        data, scale_inv = gathered[:rows], gathered_scale_inv[: -(-rows // BLOCK)]  # drop the shards' padding
        if out is not None:
            te_internals.refill_float8_blockwise(torch_fsdp2.local_of_unsharded(out), data, scale_inv)
            return None
        quantizer = self.quantizer.copy()
        return te_internals.make_float8_blockwise(data, scale_inv, param_dtype, quantizer), (gathered,
                                                                                          gathered_scale_inv)


class Fp8AllGatherShard(torch.Tensor):
    """The local shard of a converted weight as FSDP2 sees it: the same storage, plain for every op (results are
    plain tensors, pickling writes a plain tensor), plus FSDP2's all-gather extension hooks."""

    __torch_function__ = torch_fsdp2.plain_ops_class_attribute()

    def __reduce_ex__(self, protocol):
        return torch.Tensor.__reduce_ex__(_plain(self), protocol)

    def fsdp_pre_all_gather(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy):
        return self._accel_fp8_fix_all_gather.pre_all_gather(_plain(self), orig_size)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        return self._accel_fp8_fix_all_gather.post_all_gather(all_gather_outputs, metadata, param_dtype, out)


def _alias(local: torch.Tensor, state) -> "Fp8AllGatherShard":
    shard = local.as_subclass(Fp8AllGatherShard)
    shard._accel_fp8_fix_all_gather = state
    return shard


@dataclass
class Fp8AllGatherSetup:
    kind: str  # "per_tensor" (delayed / current recipes) or "block" (Float8BlockScaling)
    scales: WeightScales | None  # per_tensor: the packed amax all-reduce; block: None (tile scales are local)
    weights: list = field(default_factory=list)  # qualified names of the weights gathered in FP8

    @property
    def amax_reductions(self) -> int:
        """Weight-amax all-reduces so far (block scaling needs none)."""
        return self.scales.reductions if self.scales is not None else 0


def _chosen_weights(model, te_modules) -> list:
    """(qualified name, FSDPParam) of the weight of every converted TE Linear FSDP2 shards."""
    import transformer_engine.pytorch as te

    names = {id(m): n for n, m in model.named_modules()}
    linears = {id(m) for m in te_modules if isinstance(m, te.Linear)}
    return [(f"{names.get(id(torch_fsdp2.owner_module(p)), '?')}.weight", p) for p in torch_fsdp2.fsdp_params(model)
            if id(torch_fsdp2.owner_module(p)) in linears and torch_fsdp2.param_name(p) == "weight"]


def _block_misaligned(name: str, fsdp_param) -> str | None:
    """Why this weight's 128x128 tiles would cross an FSDP2 shard boundary (None: they do not)."""
    world = torch_fsdp2.shard_world_size(fsdp_param)
    rows = torch_fsdp2.padded_shard_size(fsdp_param)[0]
    if world == 1 or rows % BLOCK == 0:
        return None
    full = torch_fsdp2.sharded_param(fsdp_param).shape[0]
    return (f"{name}: {full} rows sharded over {world} ranks is {rows} rows a shard, not a multiple of {BLOCK}, so "
            f"128x128 tiles would cross shard boundaries")


def _problems(chosen, kind: str) -> list:
    problems = [f"{name}: {why}" for name, p in chosen if (why := torch_fsdp2.why_no_extension(p)) is not None]
    if kind == "block":
        problems += [why for name, p in chosen if (why := _block_misaligned(name, p)) is not None]
    return problems


def install(model, te_modules, recipe, group) -> Fp8AllGatherSetup:
    """Install the FP8 all-gather on the weight of every converted TE Linear of ``model`` (FSDP2-sharded); every
    weight is checked first, so a refusal leaves no weight half-switched."""
    from .fp8_all_gather_policy import block_recipe_refusal

    kind = "block" if type(recipe).__name__ == "Float8BlockScaling" else "per_tensor"
    chosen = _chosen_weights(model, te_modules)
    why = block_recipe_refusal(recipe) if kind == "block" else None
    problems = [why] if why else _problems(chosen, kind)
    if problems:
        raise Fp8AllGatherError("accel_fp8_fix: the FP8 all-gather cannot run on " + "; ".join(problems) + (
            ". Shard over fewer ranks, or remove the setting (ACCELERATE_FP8_ALL_GATHER / fp8_config all_gather)"
            if kind == "block" else ""))
    setup = Fp8AllGatherSetup(kind, WeightScales(group, scale_params(recipe)) if kind == "per_tensor" else None)
    for name, fsdp_param in chosen:
        padded = torch_fsdp2.padded_shard_size(fsdp_param)
        if kind == "block":
            quantizer = te_internals.float8_block_weight_quantizer(recipe)
            state = _BlockGather(quantizer, padded, te_internals.block_scale_shape(quantizer, *padded), name)
        else:
            state = _PerTensorGather(setup.scales, setup.scales.add(fsdp_param), padded, name)
        torch_fsdp2.install_extension(fsdp_param, functools.partial(_alias, state=state))
        setup.weights.append(name)
    how = ("128x128 tile scales computed on each shard, no amax exchange" if kind == "block"
           else "scales from one packed amax all-reduce per weight update")
    say(logger, logging.INFO, f"accel_fp8_fix: FP8 all-gather on {len(setup.weights)} weight(s); {how}")
    return setup
