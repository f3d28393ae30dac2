"""FP8 numerics and tensor-parallel comms of the emulation (quantize -> dequantize -> fp32 GEMM).

No ``torch._scaled_mm`` (about 20 s per 1024^3 GEMM on CPU); quantize/dequantize + fp32 matmul matches
it to ~1e-7 relative.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from accel_fp8_fix.emulation import _stats

_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
_FP32_MAX = torch.finfo(torch.float32).max


def cast_to_fp8(x32: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """Saturating cast of ``x32 * scale`` (TE's kernels convert with __NV_SATFINITE)."""
    fmax = _FP8_MAX[fp8_dtype]
    return (x32 * scale).clamp(-fmax, fmax).to(fp8_dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q * scale_inv`` in fp32, ``scale_inv = 1 / scale`` (TE stores the reciprocal)."""
    return q.to(torch.float32) * torch.reciprocal(scale)


def quantize_dequantize_per_tensor(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    x32 = x.detach().to(torch.float32)
    return dequantize(cast_to_fp8(x32, scale, fp8_dtype), scale)


def current_scale_from_amax(amax: torch.Tensor, fp8_max: float, pow_2: bool = False, epsilon: float = 0.0) -> torch.Tensor:
    """TE's compute_scale_from_amax (current scaling): fp8_max / amax; 1 for zero/inf amax;
    FP32_MAX for an infinite result; optional power-of-two rounding down."""
    amax = amax.to(torch.float32)
    if epsilon > 0:
        amax = torch.clamp(amax, min=epsilon)
    scale = fp8_max / amax
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, _FP32_MAX), scale)
    bad = (amax == 0) | torch.isinf(amax) | torch.isnan(amax) | torch.isnan(scale)
    scale = torch.where(bad, torch.ones_like(scale), scale)
    if pow_2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


class Float8Quantizer:
    """Delayed-scaling quantizer: uses ``state.scale[idx]``; records the amax into ``state.amax_history[0][idx]``."""

    def __init__(self, state, idx: int, dtype: torch.dtype) -> None:
        self.state = state
        self.idx = idx
        self.dtype = dtype

    @property
    def scale(self) -> torch.Tensor:
        return self.state.scale[self.idx]

    @property
    def amax(self) -> torch.Tensor:
        return self.state.amax_history[0][self.idx].reshape((1,))

    def quantize_dequantize(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        x32 = x.detach().to(torch.float32)
        with torch.no_grad():
            amax = x32.abs().amax() if x32.numel() else x32.new_zeros(())
            cur = self.state.amax_history[0, self.idx]
            self.state.amax_history[0, self.idx] = torch.maximum(cur, amax)
            scale = self.state.scale[self.idx].clone()
        return dequantize(cast_to_fp8(x32, scale, self.dtype), scale)


class Float8CurrentScalingQuantizer:
    """Current scaling: the scale comes from this tensor's amax."""

    def __init__(self, dtype: torch.dtype, force_pow_2_scales: bool = False, amax_epsilon: float = 0.0) -> None:
        self.dtype = dtype
        self.force_pow_2_scales = force_pow_2_scales
        self.amax_epsilon = amax_epsilon
        self.last_scale: Optional[torch.Tensor] = None

    def quantize_dequantize(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        x32 = x.detach().to(torch.float32)
        amax = x32.abs().amax() if x32.numel() else x32.new_zeros(())
        scale = current_scale_from_amax(amax, _FP8_MAX[self.dtype], self.force_pow_2_scales, self.amax_epsilon)
        self.last_scale = scale
        return dequantize(cast_to_fp8(x32, scale, self.dtype), scale)


class MXFP8Quantizer:
    """MXFP8: 32 consecutive values along ``dim`` share a power-of-two scale
    ``scale_inv = 2**ceil(log2(amax_block / fp8_max))`` (E8M0, rounded up so nothing saturates)."""

    BLOCK = 32

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def quantize_dequantize(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        x32 = x.detach().to(torch.float32)
        xt = x32.movedim(dim, -1)
        n = xt.shape[-1]
        pad = (-n) % self.BLOCK
        if pad:
            xt = torch.nn.functional.pad(xt, (0, pad))
        blocks = xt.reshape(*xt.shape[:-1], -1, self.BLOCK)
        amax = blocks.abs().amax(dim=-1, keepdim=True)
        fmax = _FP8_MAX[self.dtype]
        exp = torch.ceil(torch.log2(amax / fmax))
        exp = torch.where(amax > 0, exp, torch.zeros_like(exp)).clamp(-127, 127)
        scale_inv = torch.exp2(exp)
        q = (blocks / scale_inv).clamp(-fmax, fmax).to(self.dtype)
        dq = (q.to(torch.float32) * scale_inv).reshape(xt.shape)
        if pad:
            dq = dq[..., :n]
        return dq.movedim(-1, dim).contiguous()


# --------------------------------------------------------------------------------------------------
# GEMM autograd function


def _count(module, fp8: bool, n: int, forward: bool) -> None:
    if n <= 0:
        return
    if fp8:
        _stats.bump("fp8_gemms", n)
        _stats.bump("fp8_gemms_fwd" if forward else "fp8_gemms_bwd", n)
        module.__dict__["fp8_gemm_count"] = module.__dict__.get("fp8_gemm_count", 0) + n
    else:
        _stats.bump("non_fp8_gemms", n)
        _stats.bump("non_fp8_gemms_fwd" if forward else "non_fp8_gemms_bwd", n)
        module.__dict__["non_fp8_gemm_count"] = module.__dict__.get("non_fp8_gemm_count", 0) + n


class _EmulatedLinearGemm(torch.autograd.Function):
    """y = x @ w.T  (x: [tokens, in], w: [out, in]), FP8-emulated or high precision.

    FP8: x, w quantized with the forward quantizers (input idx 0, weight idx 1), grad_output with the
    backward quantizer idx 0 (E5M2 under HYBRID); all GEMMs on dequantized values in fp32.
    """

    @staticmethod
    def forward(ctx, x, w, module, fp8, q_in, q_w, q_grad, act_dtype, reduce_bwd, mx):
        with torch.autocast("cpu", enabled=False):
            if fp8:
                x_dq = q_in.quantize_dequantize(x)
                w_dq = q_w.quantize_dequantize(w)
                out = torch.matmul(x_dq, w_dq.t()).to(act_dtype)
                if mx:  # MXFP8 re-quantizes columnwise from the high-precision tensors for backward
                    ctx.save_for_backward(x, w)
                else:
                    ctx.save_for_backward(x_dq, w_dq)
            else:
                xc, wc = x.to(act_dtype), w.to(act_dtype)
                out = torch.matmul(xc, wc.t())
                ctx.save_for_backward(xc, wc)
        _count(module, fp8, 1, True)
        ctx.module, ctx.fp8, ctx.q_in, ctx.q_w, ctx.q_grad = module, fp8, q_in, q_w, q_grad
        ctx.act_dtype, ctx.reduce_bwd, ctx.mx = act_dtype, reduce_bwd, mx
        ctx.x_dtype, ctx.w_dtype = x.dtype, w.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        a, b = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx = dw = None
        n = 0
        with torch.autocast("cpu", enabled=False):
            if ctx.fp8:
                if ctx.mx:
                    x, w = a, b
                    if need_dx:
                        g_dq = ctx.q_grad.quantize_dequantize(grad_out, dim=-1)
                        w_dq = ctx.q_w.quantize_dequantize(w, dim=0)
                        dx = torch.matmul(g_dq, w_dq).to(ctx.x_dtype)
                        n += 1
                    if need_dw:
                        gt_dq = ctx.q_grad.quantize_dequantize(grad_out, dim=0)
                        xt_dq = ctx.q_in.quantize_dequantize(x, dim=0)
                        dw = torch.matmul(gt_dq.t(), xt_dq).to(ctx.w_dtype)
                        n += 1
                else:
                    x_dq, w_dq = a, b
                    g_dq = ctx.q_grad.quantize_dequantize(grad_out)
                    if need_dx:
                        dx = torch.matmul(g_dq, w_dq).to(ctx.x_dtype)
                        n += 1
                    if need_dw:
                        dw = torch.matmul(g_dq.t(), x_dq).to(ctx.w_dtype)
                        n += 1
            else:
                xc, wc = a, b
                g = grad_out.to(ctx.act_dtype)
                if need_dx:
                    dx = torch.matmul(g, wc).to(ctx.x_dtype)
                    n += 1
                if need_dw:
                    dw = torch.matmul(g.t(), xc).to(ctx.w_dtype)
                    n += 1
        _count(ctx.module, ctx.fp8, n, False)
        module = ctx.module
        if dw is not None and getattr(module, "fuse_wgrad_accumulation", False):
            weight = module.weight
            if getattr(weight, "main_grad", None) is None:
                raise RuntimeError("fuse_wgrad_accumulation=True needs weight.main_grad to be set")
            weight.main_grad.add_(dw.to(weight.main_grad.dtype))
            dw = None
        if ctx.reduce_bwd:
            from .quantization import FP8GlobalStateManager

            FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=False)
        ctx.module = ctx.q_in = ctx.q_w = ctx.q_grad = None
        return dx, dw, None, None, None, None, None, None, None, None


# --------------------------------------------------------------------------------------------------
# Tensor-parallel comms (autograd-aware, plain local tensors; sequence dim = first dim as in TE)


def _world(group) -> int:
    if group is None and not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def _all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    t = t.contiguous().clone()
    dist.all_reduce(t, group=group)
    return t


def _all_gather_first(t: torch.Tensor, group) -> torch.Tensor:
    ws = _world(group)
    parts = [torch.empty_like(t.contiguous()) for _ in range(ws)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=0)


def _reduce_scatter_first(t: torch.Tensor, group) -> torch.Tensor:
    # gloo has no reduce_scatter: all_reduce then keep this rank's chunk (same result).
    ws = _world(group)
    full = _all_reduce(t, group)
    rank = dist.get_rank(group)
    return full.chunk(ws, dim=0)[rank].contiguous()


class _CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient in backward (column-parallel input)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward; identity backward (row-parallel output)."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherFromSeq(torch.autograd.Function):
    """All-gather along the first (sequence) dim; reduce-scatter in backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_first(x, group)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter_first(g, ctx.group), None


class _ReduceScatterToSeq(torch.autograd.Function):
    """Reduce-scatter along the first (sequence) dim; all-gather in backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_first(x, group)

    @staticmethod
    def backward(ctx, g):
        return _all_gather_first(g, ctx.group), None


copy_to_tensor_parallel = _CopyToTP.apply
reduce_from_tensor_parallel = _ReduceFromTP.apply
gather_along_first_dim = _GatherFromSeq.apply
reduce_scatter_along_first_dim = _ReduceScatterToSeq.apply
