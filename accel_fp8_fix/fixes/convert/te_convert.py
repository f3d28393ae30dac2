"""Convert ``nn.Linear`` / ``nn.LayerNorm`` to Transformer Engine modules *after* sharding (A1).

The TE module is built on the ``meta`` device (no full-size allocation) and takes over the very same
Parameter objects, DTensor shards included, so the optimizer needs no remapping and no rank ever holds
a full copy. FSDP2 swaps parameters by ``setattr`` on the module it recorded at ``fully_shard`` time:
that record is moved to the new module. A TP-sharded Linear (weight ``Shard(0)`` = column parallel,
``Shard(1)`` = row parallel) becomes a TE module configured for TE's own TP on the TP group; TE kernels
take local tensors, so during forward the module sees its parameters' local shards (autograd carries the
gradients back to the DTensor parameters). A Linear TE cannot take (a dim not divisible by 16) stays
``nn.Linear`` with one warning, and its siblings are still converted.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from ..._log import say
from ...internals import torch_fsdp2, transformers_tp
from ...internals.transformer_engine import has_fp8_state
from .fp8_shapes import FP8_LAST_MULTIPLE, install_token_check, local_dims, local_dims_fit
from .local_shards import install_local_shards
from .moe_experts import convert_experts
from .tp_layout import is_output_layer, tp_layout_of

logger = logging.getLogger(__name__)


def _adapter(module: nn.Module, mode) -> str | None:
    """"gather_output" / "split_input" when the module's TP style is TE's ``mode`` plus one redistribution."""
    from torch.distributed.tensor import Replicate

    style = transformers_tp.tp_style(module)
    layouts = transformers_tp.style_layouts(style) if style is not None else None
    if layouts is None:
        return None
    inp, out, local = layouts
    if not local:
        return None
    if mode == "column" and inp == Replicate() and out == Replicate():
        return "gather_output"
    if mode == "row" and inp == Replicate() and out == Replicate():
        return "split_input"
    return None


class _GatherOutput:
    """Forward hook: TE column mode returns this rank's slice of the output features; the style gathers them
    (backward: each rank keeps its slice of the gradient) — transformers' own redistribution, on the TP mesh."""

    def __init__(self, tp_mesh):
        self.tp_mesh = tp_mesh

    def __call__(self, module, args, output):
        from torch.distributed.tensor import DTensor, Replicate, Shard

        local = DTensor.from_local(output, self.tp_mesh, [Shard(-1)], run_check=False)
        return local.redistribute(placements=[Replicate()]).to_local()


class _SplitInput:
    """Forward pre-hook: the input arrives replicated, TE row mode takes this rank's slice of its last dim
    (backward: the slices' gradients are gathered into the replicated input's)."""

    def __init__(self, tp_mesh):
        self.tp_mesh = tp_mesh

    def __call__(self, module, args):
        from torch.distributed.tensor import DTensor, Replicate, Shard

        full = DTensor.from_local(args[0], self.tp_mesh, [Replicate()], run_check=False)
        return (full.redistribute(placements=[Shard(-1)]).to_local(),) + tuple(args[1:])


@dataclass
class ConversionReport:
    converted: list = field(default_factory=list)  # qualified names
    skipped: list = field(default_factory=list)  # (qualified name, reason)
    te_modules: list = field(default_factory=list)  # every TE module with FP8 state, converted or not
    experts: list = field(default_factory=list)  # packed MoE experts running TE grouped GEMMs (fixes/convert/moe_experts.py)


def _te_tp_mismatch(module: nn.Module, mode) -> str | None:
    """Why TE's own TP cannot reproduce the layout transformers gave this Linear (None when it can).

    TE column mode takes the full input and returns the local output shard; row mode takes the local
    input shard and returns the all-reduced output. Two more layouts are TE's plus one redistribution
    (:func:`_adapter`): a column layer whose output is gathered (Phi3's fused ``qkv_proj`` / ``gate_up_proj``,
    ``colwise_gather_output``) and a row layer whose input arrives replicated (``rowwise_split_input``).
    The model's output layer (lm_head) keeps transformers' TP in high precision; so does a style this
    package does not know (fail closed).
    """
    style = transformers_tp.tp_style(module)
    if style is None or mode is None:
        return None
    layouts = transformers_tp.style_layouts(style)
    if layouts is None:
        return f"its TP style {type(style).__name__} is not one this package knows ({', '.join(transformers_tp.KNOWN_STYLES)})"
    from torch.distributed.tensor import Replicate, Shard

    inp, out, local = layouts
    want = {"column": (Replicate(), Shard(-1)), "row": (Shard(-1), Replicate())}[mode]
    if (inp, out) == want and local:
        return None
    if _adapter(module, mode) is not None:
        if is_output_layer(module):
            return (f"it is the model's output layer (logits; TP style {type(style).__name__} gathers its output): "
                    "kept in high precision with transformers' TP")
        return None
    return (f"its TP style {type(style).__name__}(input {inp}, output {out}, local output {local}) has no "
            f"Transformer Engine {mode}-parallel equivalent")


def _take_over_parameters(old: nn.Module, new: nn.Module, names) -> None:
    for name in names:
        param = getattr(old, name, None)
        # Direct dict assignment: the same Parameter object, without TE's register_parameter bookkeeping.
        new._parameters[name] = param


def _new_linear(te, linear: nn.Linear, name: str):
    mode, tp_mesh = tp_layout_of(linear)
    tp_kwargs = {}
    if tp_mesh is not None and mode is not None and tp_mesh.size() > 1:
        tp_kwargs = {"tp_group": tp_mesh.get_group(), "tp_size": tp_mesh.size(), "parallel_mode": mode}
    return te.Linear(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        params_dtype=linear.weight.dtype,
        device="meta",
        **tp_kwargs,
    )


def _new_layernorm(te, norm: nn.LayerNorm, name: str):
    return te.LayerNorm(norm.normalized_shape[0], eps=norm.eps, params_dtype=norm.weight.dtype, device="meta")


def convert_after_sharding(model: nn.Module, te, *, convert_layernorm: bool = True, exclude=(),
                           dim_multiple: int = FP8_LAST_MULTIPLE, moe_experts: bool = True) -> ConversionReport:
    """Swap supported modules for TE ones in place, keeping every Parameter object; return what happened.
    ``moe_experts``: packed MoE experts run their GEMMs as TE grouped GEMMs on their own 3-D parameters too.

    ``exclude``: qualified module names to keep as they are (e.g. ``("lm_head",)``).
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        FSDPModule = ()
    report = ConversionReport()
    fsdp_params = torch_fsdp2.fsdp_params(model)
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            if name in exclude:
                continue
            if isinstance(child, nn.Linear):
                mode, tp_mesh = tp_layout_of(child)
                tp_size = tp_mesh.size() if tp_mesh is not None else 1
                in_local, out_local = local_dims(child.in_features, child.out_features, mode, tp_size)
                if not local_dims_fit(in_local, out_local, dim_multiple):
                    shard = "" if (in_local, out_local) == (child.in_features, child.out_features) else (
                        f" ({mode}-parallel shard on this rank: {in_local} x {out_local})")
                    reason = (f"in_features={child.in_features}, out_features={child.out_features}{shard}: TE's FP8 "
                              f"GEMMs need multiples of {dim_multiple}")
                elif isinstance(child, FSDPModule):
                    reason = "it is an FSDP2 unit of its own (its unshard hooks live on this module object)"
                else:
                    reason = _te_tp_mismatch(child, mode)
                if reason is not None:
                    report.skipped.append((name, reason))
                    continue
                new = _new_linear(te, child, name)
                install_token_check(new, name)
                adapter = _adapter(child, mode) if tp_size > 1 else None
                if adapter == "gather_output":
                    new.register_forward_hook(_GatherOutput(tp_mesh))
                elif adapter == "split_input":  # before the token check: it checks the slice TE gets
                    new.register_forward_pre_hook(_SplitInput(tp_mesh), prepend=True)
                names = ["weight"] + (["bias"] if child.bias is not None else [])
            elif convert_layernorm and isinstance(child, nn.LayerNorm):
                if len(child.normalized_shape) != 1 or child.weight is None or child.bias is None:
                    report.skipped.append((name, "TE LayerNorm needs 1-D normalized_shape with affine weight and bias"))
                    continue
                if isinstance(child, FSDPModule):
                    report.skipped.append((name, "it is an FSDP2 unit of its own"))
                    continue
                new = _new_layernorm(te, child, name)
                names = ["weight", "bias"]
            else:
                continue
            with torch.no_grad():
                _take_over_parameters(child, new, names)
            new.train(child.training)
            torch_fsdp2.retarget(fsdp_params, child, new)
            tp_mesh = tp_layout_of(child)[1]
            if tp_mesh is not None:
                install_local_shards(new, names, tp_mesh)
            setattr(parent, child_name, new)
            report.converted.append(name)
    if moe_experts:
        report.experts, kept = convert_experts(model, te, dim_multiple, exclude=exclude)
        report.skipped += kept
    if report.skipped:
        detail = "; ".join(f"{n}: {why}" for n, why in report.skipped)
        say(logger, logging.WARNING,
            f"accel_fp8_fix: kept {len(report.skipped)} module(s) in high precision, not Transformer Engine: {detail}")
    report.te_modules = [m for m in model.modules() if has_fp8_state(m)]
    return report
