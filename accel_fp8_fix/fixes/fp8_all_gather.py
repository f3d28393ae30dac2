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
scaling). MXFP8, NVFP4 and Float8 block scaling are refused by name at ``prepare``.
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


@dataclass
class _ShardState:
    scales: WeightScales
    index: int
    padded_size: torch.Size
    name: str


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.as_subclass(torch.Tensor)


class Fp8AllGatherShard(torch.Tensor):
    """The local shard of a converted weight as FSDP2 sees it: the same storage, plain for every op (results are
    plain tensors, pickling writes a plain tensor), plus FSDP2's all-gather extension hooks."""

    __torch_function__ = torch_fsdp2.plain_ops_class_attribute()

    def __reduce_ex__(self, protocol):
        return torch.Tensor.__reduce_ex__(_plain(self), protocol)

    def fsdp_pre_all_gather(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy):
        state: _ShardState = self._accel_fp8_fix_all_gather
        scales = state.scales
        scales.refresh()
        i = state.index
        bits = torch.zeros(state.padded_size, dtype=torch.uint8, device=self.device)
        if self.numel():
            quantizer = te_internals.float8_quantizer(scales.scale[i:i + 1].clone(), scales.params.fp8_dtype)
            quantized = te_internals.quantized_bits(quantizer(_plain(self).detach()))
            if quantized.shape == bits.shape:
                bits = quantized
            else:
                bits[: quantized.shape[0]].copy_(quantized)
        return (bits,), (scales.scale_inv[i:i + 1].clone(), tuple(orig_size))

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        state: _ShardState = self._accel_fp8_fix_all_gather
        (gathered,) = all_gather_outputs
        scale_inv, orig_size = metadata
        data = gathered[: orig_size[0]]  # uneven sharding: FSDP2 pads each shard's rows
        fp8_dtype = state.scales.params.fp8_dtype
        if out is not None:
            te_internals.refill_float8(torch_fsdp2.local_of_unsharded(out), data, scale_inv)
            return None
        # Row-wise bytes only. On Hopper dgrad needs the transposed bytes: TE derives them from these in backward
        # (``update_usage(columnwise_usage=True)``) and, for a module under FSDP2, drops them right after the dgrad
        # GEMM (``clear_columnwise_cache``), so they never outlive one module's backward.
        quantizer = te_internals.float8_quantizer(torch.reciprocal(scale_inv), fp8_dtype)
        tensor = te_internals.make_float8(data, scale_inv, fp8_dtype, param_dtype, quantizer)
        return tensor, (gathered,)


def _alias(local: torch.Tensor, state: _ShardState) -> "Fp8AllGatherShard":
    shard = local.as_subclass(Fp8AllGatherShard)
    shard._accel_fp8_fix_all_gather = state
    return shard


@dataclass
class Fp8AllGatherSetup:
    scales: WeightScales
    weights: list = field(default_factory=list)  # qualified names of the weights gathered in FP8


def install(model, te_modules, recipe, group) -> Fp8AllGatherSetup:
    """Install the FP8 all-gather on the weight of every converted TE Linear of ``model`` (FSDP2-sharded)."""
    import transformer_engine.pytorch as te

    names = {id(m): n for n, m in model.named_modules()}
    linears = {id(m) for m in te_modules if isinstance(m, te.Linear)}
    chosen = [p for p in torch_fsdp2.fsdp_params(model)
              if id(torch_fsdp2.owner_module(p)) in linears and torch_fsdp2.param_name(p) == "weight"]
    problems = [f"{names.get(id(torch_fsdp2.owner_module(p)), '?')}.weight: {why}" for p in chosen
                if (why := torch_fsdp2.why_no_extension(p)) is not None]
    if problems:
        raise Fp8AllGatherError("accel_fp8_fix: the FP8 all-gather cannot run on " + "; ".join(problems))
    setup = Fp8AllGatherSetup(WeightScales(group, scale_params(recipe)))
    for fsdp_param in chosen:
        name = f"{names.get(id(torch_fsdp2.owner_module(fsdp_param)), '?')}.weight"
        state = _ShardState(setup.scales, setup.scales.add(fsdp_param), torch_fsdp2.padded_shard_size(fsdp_param), name)
        torch_fsdp2.install_extension(fsdp_param, functools.partial(_alias, state=state))
        setup.weights.append(name)
    say(logger, logging.INFO, f"accel_fp8_fix: FP8 all-gather on {len(setup.weights)} weight(s); scales from one "
        f"packed amax all-reduce per weight update")
    return setup
