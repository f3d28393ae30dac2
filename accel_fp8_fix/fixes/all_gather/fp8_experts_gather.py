"""Packed MoE experts all-gathered in FP8 under FSDP2 (``all_gather: fp8``; the switch of fixes/all_gather/fp8_all_gather.py).

An experts module converted by fixes/convert/moe_experts.py keeps transformers' 3-D parameters (``gate_up_proj``,
``down_proj``: ``[E, out, in]``, GPT-OSS ``[E, in, out]``), which FSDP2 shards on dim 0 — each shard holds whole
experts. With the switch on, each expert is quantized on its shard with its OWN per-tensor scale (the scale TE's
``GroupedLinear`` gives each of its ``num_gemms`` weights: per-expert, never one scale for all experts), FSDP2
gathers 1 byte a parameter, and the unsharded parameter is an :class:`Fp8Experts`: the gathered bytes plus the E
scales. The experts' forward hands TE's grouped GEMM one ``Float8Tensor`` per expert (views of the gathered bytes;
GPT-OSS's ``[in, out]`` bytes transposed contiguous — exact: one scale per expert), which TE uses as it is; each
expert's weight gradient flows back, stacked, to the 3-D parameter FSDP2 reduce-scatters.

Scales: the per-expert amaxes ride in the switch's ONE packed weight-amax all-reduce per weight update
(fixes/all_gather/fp8_weight_record.py ``WeightScales``, a slot per expert; a rank's experts it does not hold count 0), issued
outside FSDP2's hooks, before the step's first unshard. Masters, optimizer state and checkpoints stay in the master
dtype (the shard is the same alias class as a Linear's, pickling as a plain tensor).

Float8 block scaling: each expert quantized tile by tile (128x128) on its shard — a tile never crosses an expert,
an expert never crosses a shard — with no amax exchange; the experts' scale grids gathered beside the bytes (E
must divide the shard ranks: FSDP2's uneven-shard rule) and handed to TE per expert as 2-D-scaled
``Float8BlockwiseQTensor``s.

Served under the per-tensor recipes (delayed / current; under delayed the weights are current-scaled, as for
Linears): experts under FSDP2, HSDP, FSDP2 x TP (each rank's TP slice of every expert quantized at the whole
expert's scale: the slices' amaxes meet in the same MAX) and transformers' expert parallelism (a slot per GLOBAL
expert: a shard's first expert is its DTensor offset, ``ep`` included; FSDP2 re-wraps the gathered ``Fp8Experts``
in a DTensor on the other dims, whose local tensor the experts' forward receives). Under Float8 block scaling:
experts sharded by FSDP2 / HSDP only. Kept in the policy's dtype, named in a warning and
``setup.all_gather.kept``: under block scaling, experts under EP or TP, GPT-OSS's ``[E, in, out]`` experts and an E
that the shard ranks do not divide.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...internals import torch_fsdp2
from ...internals import transformer_engine as te_internals
from ..convert import moe_experts

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def _plain_args(value):
    return value.dequantize() if isinstance(value, Fp8Experts) else value


class Fp8Experts(torch.Tensor):
    """The unsharded 3-D experts weight FSDP2 hands the module under the FP8 all-gather: uint8 bytes ``[E, a, b]``
    and the experts' fp32 ``scale_inv``s — one per expert (per-tensor recipes: ``[E]``, with a quantizer per expert)
    or a 128x128 tile grid per expert (Float8 block scaling: ``[E, tiles of a, padded tiles of b]``, one block
    quantizer) — nominally the policy's dtype. FSDP2's own handling (``as_strided`` to its shape, ``nn.Parameter``'s
    detach) keeps it; any other op sees the dequantized weight (TE's dequantization, expert by expert) and an
    in-place op is refused — only the experts' forward reads the bytes (:meth:`expert_weights`)."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, data, scale_inv, quantizers, dtype, requires_grad=False):
        self = torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=dtype, device=data.device,
                                                   requires_grad=requires_grad)
        self._data, self._expert_scale_inv, self._quantizers = data, scale_inv, quantizers
        return self

    def __repr__(self, *, tensor_contents=None):
        return f"Fp8Experts(shape={tuple(self.shape)}, dtype={self.dtype}, experts={self.shape[0]})"

    def __tensor_flatten__(self):
        return ["_data", "_expert_scale_inv"], (self._quantizers, self.dtype)

    @staticmethod
    def __tensor_unflatten__(inner, context, outer_size, outer_stride):
        quantizers, dtype = context
        return Fp8Experts(inner["_data"], inner["_expert_scale_inv"], quantizers, dtype)

    def _alias(self):
        return Fp8Experts(self._data, self._expert_scale_inv, self._quantizers, self.dtype)

    @property
    def block_scaled(self) -> bool:
        return not isinstance(self._quantizers, (list, tuple))

    def expert(self, e: int, transposed: bool = False):
        """Expert ``e`` as TE's quantized tensor ``[out, in]`` (GPT-OSS's ``[in, out]`` bytes transposed; per-tensor
        scales only): a ``Float8Tensor``, or a 2-D-scaled ``Float8BlockwiseQTensor`` under block scaling."""
        data = self._data[e]
        if self.block_scaled:
            return te_internals.make_float8_blockwise(data, self._expert_scale_inv[e], self.dtype,
                                                      self._quantizers.copy())
        if transposed:
            data = data.t().contiguous()
        quantizer = self._quantizers[e]
        return te_internals.make_float8(data, self._expert_scale_inv[e:e + 1], quantizer.dtype, self.dtype, quantizer)

    def dequantize(self) -> torch.Tensor:
        return torch.stack([self.expert(e).dequantize() for e in range(self.shape[0])]) if self.shape[0] else \
            torch.empty(self.shape, dtype=self.dtype, device=self.device)

    def expert_weights(self, transposed: bool = False) -> tuple:
        """One ``Float8Tensor`` ``[out, in]`` per expert for TE's grouped GEMM; their gradients, stacked, are this
        parameter's (autograd)."""
        return _PerExpertFloat8.apply(self, transposed)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        aten = torch.ops.aten
        source = args[0] if args else None
        if isinstance(source, Fp8Experts):
            if func in (aten.detach.default, aten.alias.default):
                return source._alias()
            if func is aten.as_strided.default and tuple(args[1]) == tuple(source.shape) and (
                    tuple(args[2]) == tuple(source._data.stride())) and (len(args) < 4 or args[3] in (0, None)):
                return source._alias()
            if func in (aten.view.default, aten._unsafe_view.default) and tuple(args[1]) == tuple(source.shape):
                return source._alias()
        if func._schema.is_mutable and any(isinstance(a, Fp8Experts) for a in args):
            raise RuntimeError(f"accel_fp8_fix: {func} on an experts weight gathered in FP8 (fixes/"
                               "fp8_experts_gather.py): it is a read-only FSDP2 unsharded view; change the sharded "
                               "parameter (the DTensor the optimizer steps) instead")
        args = torch.utils._pytree.tree_map(_plain_args, args)
        kwargs = torch.utils._pytree.tree_map(_plain_args, kwargs)
        return func(*args, **kwargs)


class _PerExpertFloat8(torch.autograd.Function):
    """``Fp8Experts`` -> one ``Float8Tensor`` per expert; backward stacks the experts' gradients (transposed back
    for ``[E, in, out]`` weights) into the 3-D parameter's, in its dtype."""

    @staticmethod
    def forward(ctx, experts, transposed):
        ctx.transposed, ctx.dtype = transposed, experts.dtype
        return tuple(experts.expert(e, transposed) for e in range(experts.shape[0]))

    @staticmethod
    def backward(ctx, *grads):  # autograd materialises an unused expert's gradient as zeros (never None)
        stacked = torch.stack([g.to(ctx.dtype) for g in grads])
        return (stacked.transpose(1, 2).contiguous() if ctx.transposed else stacked), None


@dataclass
class ExpertsPerTensorGather:
    """One packed-experts weight under per-tensor recipes: each local expert quantized with its own scale (from
    :class:`~accel_fp8_fix.fixes.all_gather.fp8_weight_record.WeightScales`, computed before the step's first unshard), the
    bytes gathered, the E scales in the metadata (every rank has all of them after the packed all-reduce)."""
    scales: object  # WeightScales
    index: int  # in ``scales``
    record_index: int
    padded_size: torch.Size  # of one shard: [ceil(E / shards), a, b]
    name: str

    def pre_all_gather(self, local: torch.Tensor, orig_size):
        scales = self.scales
        scales.record.check_current(self.record_index)
        quantizers = scales.quantizers_of(self.index)
        first = scales.record.first_row(self.record_index)
        bits = torch.zeros(self.padded_size, dtype=torch.uint8, device=local.device)
        for row in range(local.shape[0] if local.numel() else 0):
            bits[row].copy_(te_internals.quantized_bits(quantizers[first + row](local[row].detach())))
        # the gathered tensor's experts (under EP: this EP rank's) are global experts [start, start + rows)
        start = scales.record.first_unsharded_row(self.record_index)
        rows = slice(start, start + orig_size[0])
        return (bits,), (scales.scale_inv_views[self.index][rows], tuple(orig_size), rows)

    def post_all_gather(self, outputs, metadata, param_dtype, out):
        (gathered,) = outputs
        scale_inv, orig_size, rows = metadata
        data = gathered[: orig_size[0]]  # uneven sharding: FSDP2 pads each shard's experts
        if out is not None:
            experts = torch_fsdp2.local_of_unsharded(out)
            experts._data = data
            experts._expert_scale_inv.copy_(scale_inv)
            return None
        with torch.inference_mode(False):
            own_scale_inv = scale_inv.clone()  # the experts' Float8Tensors view it; later gathers copy into it
        quantizers = self.scales.quantizers_of(self.index)[rows]
        return Fp8Experts(data, own_scale_inv, quantizers, param_dtype), (gathered,)


@dataclass
class ExpertsBlockGather:
    """One packed-experts weight under Float8BlockScaling: each local expert quantized tile by tile (128x128, a
    scale each: no amax exchange — every tile lies in one expert, every expert in one shard); over several shard
    ranks FSDP2 gathers the bytes and the experts' scale grids (both stacked along experts: E divides the shard
    ranks, checked), over one the grids ride in the metadata (FSDP2's world-size-1 path copies only the first
    input)."""
    quantizer: object
    padded_size: torch.Size  # [E / shards, a, b]
    scale_shape: tuple  # of one expert: [ceil(a / 128), roundup(ceil(b / 128), 4)]
    name: str
    gather_scales: bool

    def pre_all_gather(self, local: torch.Tensor, orig_size):
        bits = torch.empty(self.padded_size, dtype=torch.uint8, device=local.device)
        grids = torch.empty((self.padded_size[0], *self.scale_shape), dtype=torch.float32, device=local.device)
        for row in range(local.shape[0]):
            data, sinv = te_internals.block_rowwise(self.quantizer(local[row].detach()))
            if tuple(sinv.shape) != self.scale_shape:  # TE's get_scale_shape said otherwise at install
                raise RuntimeError(f"accel_fp8_fix: FP8 all-gather of {self.name}: an expert's tile scales came "
                                   f"out {tuple(sinv.shape)}, not {self.scale_shape}")
            bits[row].copy_(data)
            grids[row].copy_(sinv)
        if self.gather_scales:
            return (bits, grids), (tuple(orig_size), None)
        return (bits,), (tuple(orig_size), grids)

    def post_all_gather(self, outputs, metadata, param_dtype, out):
        orig_size, grids = metadata
        if grids is None:  # gathered with the bytes
            grids = outputs[1]
        data, grids = outputs[0][: orig_size[0]], grids[: orig_size[0]]
        if out is not None:
            experts = torch_fsdp2.local_of_unsharded(out)
            experts._data, experts._expert_scale_inv = data, grids
            return None
        return Fp8Experts(data, grids, self.quantizer, param_dtype), tuple(outputs)


def chosen_experts(model) -> list:
    """(qualified name, experts module, FSDPParam) of the 3-D weights of every converted experts module FSDP2
    shards."""
    names = {id(m): n for n, m in model.named_modules()}
    out = []
    for p in torch_fsdp2.fsdp_params(model):
        module = torch_fsdp2.owner_module(p)
        if moe_experts.is_converted(module) and torch_fsdp2.param_name(p) in EXPERT_WEIGHTS:
            out.append((f"{names.get(id(module), '?')}.{torch_fsdp2.param_name(p)}", module, p))
    return out


def why_kept(module, fsdp_param, kind: str) -> str | None:
    """Why this experts weight stays in the policy's dtype under the FP8 all-gather (None: it is gathered in FP8)."""
    if kind == "block" and (moe_experts._expert_parallel(module) or moe_experts._tp_size(module)[0] > 1):
        return ("Float8 block scaling of experts under expert parallelism or TP: served under the per-tensor "
                "recipes")
    if kind == "block":
        if moe_experts._transposed(module):
            return ("Float8 block scaling of [E, in, out] experts (GPT-OSS's layout): TE's GEMM needs [out, in] tiles; "
                    "served under the per-tensor recipes")
        experts, shards = torch_fsdp2.sharded_param(fsdp_param).shape[0], torch_fsdp2.shard_world_size(fsdp_param)
        if shards > 1 and experts % shards:
            return (f"Float8 block scaling with {experts} experts over {shards} shard ranks (uneven): FSDP2 requires "
                    "every all-gather input of an unevenly sharded parameter to have the padded shard's size, and "
                    "the tile scales are a second input of another size")
    return torch_fsdp2.why_no_extension(fsdp_param)
