"""``audit(model)``: what runs in FP8, how every parameter is placed, and what would make DTensor fail.

It automates the hand checklist of the DTensor write-ups: TE or not (and why not: the conversion report),
FP8 on or off, each parameter's type / mesh dims / placements, registered FP8 state, tensors held outside
parameters and buffers ("stray" state), modules mixing DTensor and plain tensors, TP placement vs TE's
``parallel_mode``, the amax reduction group and the FSDP2 unit of every module; plus an FP8 coverage figure
over the GEMM parameters. Read-only: it inspects, it never changes the model and issues no collective.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from ..distributed.dtensor import is_dtensor
from ..fixes.convert import moe_experts
from ..fixes.convert.fp8_state import state_link_of
from ..internals.transformer_engine import GEMMS_PER_MODULE

__all__ = ["audit", "AuditReport", "ModuleAudit", "ParamAudit", "Coverage", "remember_setup", "warn_partial_coverage"]

# Prepared models -> the accelerator's Fp8Setup (set by the patched prepare), so audit(model) needs nothing else.
_SETUPS: "weakref.WeakKeyDictionary[nn.Module, object]" = weakref.WeakKeyDictionary()
GEMMS_PER_TE_MODULE = GEMMS_PER_MODULE


def remember_setup(model: nn.Module, setup) -> None:
    try:
        _SETUPS[model] = setup
    except TypeError:  # pragma: no cover - a module that cannot be weakly referenced
        pass


@dataclass
class ParamAudit:
    name: str  # qualified
    kind: str  # "DTensor" | "plain"
    shape: tuple  # global shape
    dtype: str
    mesh_dims: tuple = ()  # names (or indices) of the DTensor's mesh dims
    placements: tuple = ()  # str of each placement


@dataclass
class ModuleAudit:
    name: str
    type: str  # class name, "te.Linear" for Transformer Engine
    is_te: bool
    fp8: bool  # its GEMMs run in FP8
    why_not: str = ""  # why it is not TE / why FP8 is off (empty when TE with FP8 on)
    parallel_mode: str | None = None
    tp_check: str = ""  # "" when consistent / not TP; else what does not match
    fsdp_unit: str | None = None  # qualified name of the FSDP2 unit managing its parameters ("" = root)
    params: list = field(default_factory=list)  # ParamAudit, direct parameters only
    fp8_state: list = field(default_factory=list)  # registered FP8 state buffers
    stray: list = field(default_factory=list)  # attribute paths of tensors outside parameters and buffers
    mixed: bool = False  # DTensor and plain tensors among its parameters / (non-FP8-state) buffers
    gemm: bool = False  # holds GEMM weights (Linear-like, TE GEMM module, Conv1D, 3-D experts, router)


@dataclass
class Coverage:
    """FP8 coverage of the GEMMs that have parameters (Linear-like weights, TE weights, Conv1D, 3-D experts).

    Attention's activation x activation GEMMs (QK^T, PV) have no parameter and are not counted."""

    fp8_params: int = 0  # elements of GEMM weights in FP8 modules (global sizes)
    gemm_params: int = 0  # elements of all GEMM weights
    fp8_gemms_per_step: int = 0  # forward + dgrad + wgrad (no wgrad for a frozen weight); one per expert
    gemms_per_step: int = 0
    high_precision: list = field(default_factory=list)  # (weight's module / parameter name, reason)

    @property
    def fp8_param_share(self) -> float:
        return self.fp8_params / self.gemm_params if self.gemm_params else 0.0

    @property
    def fp8_gemm_share(self) -> float:
        return self.fp8_gemms_per_step / self.gemms_per_step if self.gemms_per_step else 0.0

    def __str__(self) -> str:
        head = (f"FP8 coverage: {self.fp8_param_share:.1%} of GEMM parameters ({self.fp8_params}/{self.gemm_params}), "
                f"{self.fp8_gemms_per_step}/{self.gemms_per_step} GEMMs per step ({self.fp8_gemm_share:.1%})")
        return "\n".join([head] + [f"  high precision: {n} - {why}" for n, why in self.high_precision])


@dataclass
class AuditReport:
    modules: list  # ModuleAudit for every module holding parameters, TE state or stray tensors
    coverage: Coverage
    amax_group_ranks: tuple | None  # None: no amax group set up by this package
    fp8_enabled: bool  # the model's forward runs under TE autocast (this package's prepare)
    fixes_prepared: bool  # prepared by this package's patched prepare
    mesh: str | None = None

    # -- views for tests and tools --------------------------------------------------------------------
    def module(self, name: str) -> ModuleAudit:
        for m in self.modules:
            if m.name == name:
                return m
        raise KeyError(name)

    @property
    def te_modules(self) -> list:
        return [m for m in self.modules if m.is_te]

    @property
    def fp8_modules(self) -> list:
        return [m for m in self.modules if m.fp8]

    @property
    def kept(self) -> list:
        """(name, reason) of Linear-like modules not in FP8."""
        return [(m.name, m.why_not) for m in self.modules if m.gemm and not m.fp8]

    @property
    def stray(self) -> list:
        return [f"{m.name}.{p}" if m.name else p for m in self.modules for p in m.stray]

    @property
    def mixed(self) -> list:
        return [m.name for m in self.modules if m.mixed]

    @property
    def tp_mismatches(self) -> list:
        return [(m.name, m.tp_check) for m in self.modules if m.tp_check]

    def as_dict(self) -> dict:
        from dataclasses import asdict

        out = asdict(self)
        out["coverage"].update(fp8_param_share=self.coverage.fp8_param_share,
                               fp8_gemm_share=self.coverage.fp8_gemm_share)
        out["summary"] = self.summary
        return out

    # -- for people -----------------------------------------------------------------------------------
    @property
    def summary(self) -> str:
        linears = [m for m in self.modules if m.gemm]
        fp8 = [m for m in linears if m.fp8]
        native_tp = sum(1 for m in fp8 if m.parallel_mode)
        if not self.te_modules:
            head = "FP8 OFF: no Transformer Engine module" + (f" ({len(linears)} Linear kept)" if linears else "")
        elif not fp8:
            head = f"FP8 OFF: {len(self.te_modules)} Transformer Engine module(s), none runs FP8"
        else:
            head = f"{len(fp8)} Linear in FP8" + (" with TE-native TP" if native_tp == len(fp8) else (
                f" ({native_tp} with TE-native TP)" if native_tp else ""))
        kept = [(n, why) for n, why in self.kept]
        if kept and fp8:
            head += f", {len(kept)} kept: " + "; ".join(f"{n} \u2014 {_short(why)}" for n, why in kept[:3]) + (
                "; ..." if len(kept) > 3 else "")
        group = f"amax group {len(self.amax_group_ranks)} ranks" if self.amax_group_ranks else "no amax group"
        return (f"{head}; {group}; {len(self.stray)} stray tensors; {len(self.mixed)} mixed modules; "
                f"FP8 GEMM share {self.coverage.fp8_gemm_share:.0%}")

    def table(self) -> str:
        rows = [("module", "type", "FP8", "TP", "FSDP2 unit", "params", "FP8 state", "notes")]
        for m in self.modules:
            params = ", ".join(
                f"{p.name.rsplit('.', 1)[-1]}:{p.kind}" + (f"{list(p.placements)}" if p.placements else "")
                for p in m.params) or "-"
            notes = [n for n in (m.why_not, m.tp_check, "MIXED DTensor/plain" if m.mixed else "",
                                 f"stray: {', '.join(m.stray)}" if m.stray else "") if n]
            rows.append((m.name or "(root)", m.type, "yes" if m.fp8 else "no", m.parallel_mode or "-",
                         "-" if m.fsdp_unit is None else (m.fsdp_unit or "(root)"), params,
                         str(len(m.fp8_state)) if m.fp8_state else "-", "; ".join(notes) or "-"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows)

    def __str__(self) -> str:
        return "\n".join([self.summary, str(self.coverage), self.table()])


def _short(why: str) -> str:
    if "FSDP2 unit" in why:
        return "its own FSDP2 unit"
    if "output layer" in why:
        return "output layer, transformers' TP"
    if "no Transformer Engine" in why and "TP style" in why:
        return "TP layout TE cannot express"
    return why.split(":")[0][:80]


def _is_te(module) -> bool:
    return type(module).__module__.startswith("transformer_engine")  # te.LayerNorm has no fp8_meta


def _type_name(module) -> str:
    if moe_experts.is_converted(module):
        return f"{type(module).__name__} (te.GroupedLinear x{len(moe_experts.RUNNERS)})"
    return ("te." if _is_te(module) else "") + type(module).__name__


def _experts_fp8(module) -> bool:
    """Packed MoE experts whose grouped GEMMs ran in FP8 (their TE runners' last forward)."""
    return any(getattr(getattr(module, r, None), "fp8", False) for r in moe_experts.RUNNERS)


def _param_audit(name, p) -> ParamAudit:
    if is_dtensor(p):
        mesh = p.device_mesh
        dims = tuple(mesh.mesh_dim_names or range(mesh.ndim))
        return ParamAudit(name, "DTensor", tuple(p.shape), str(p.dtype).replace("torch.", ""), dims,
                          tuple(str(x) for x in p.placements))
    return ParamAudit(name, "plain", tuple(p.shape), str(p.dtype).replace("torch.", ""))


def _fsdp_units(model) -> dict:
    """{module: name of the nearest FSDP2 unit (itself or an ancestor)}; absent when none."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return {}
    units = {}

    def visit(module, prefix, unit):
        if isinstance(module, FSDPModule):
            unit = prefix
        if unit is not None:
            units[module] = unit
        for child_name, child in module.named_children():
            visit(child, f"{prefix}.{child_name}" if prefix else child_name, unit)

    visit(model, "", None)
    return units


def _forward_under_autocast(model) -> bool:
    forward = getattr(model, "forward", None)
    return bool(getattr(getattr(forward, "__func__", forward), "_accel_fp8_fix_autocast", False))


def _tp_check(module, mode) -> str:
    """'' when TE's parallel_mode matches how the weight is sharded on the TP dim; else what is wrong."""
    weight = getattr(module, "weight", None)
    if weight is None or not is_dtensor(weight):
        return ""
    mesh = weight.device_mesh
    names = tuple(mesh.mesh_dim_names or ())
    tp_group = getattr(module, "tp_group", None)
    tp_dim = None
    if "tp" in names:
        tp_dim = names.index("tp")
    elif tp_group is not None and mode:
        import torch.distributed as dist

        ranks = set(dist.get_process_group_ranks(tp_group))
        for d in range(mesh.ndim):
            if set(dist.get_process_group_ranks(mesh.get_group(d))) == ranks:
                tp_dim = d
    if tp_dim is None:
        return f"TE parallel_mode={mode!r} but the weight's mesh has no 'tp' dim" if mode else ""
    placement = weight.placements[tp_dim]
    sharded = placement.is_shard() if hasattr(placement, "is_shard") else False
    want = {"column": 0, "row": 1}.get(mode)
    if mode is None:
        return (f"weight is {placement} on mesh dim 'tp' but TE runs it with parallel_mode=None (as a full weight)"
                if sharded else "")
    if not sharded or getattr(placement, "dim", None) != want:
        return f"TE parallel_mode={mode!r} needs Shard({want}) on 'tp', the weight is {placement}"
    tp_size = getattr(module, "tp_size", None)
    if tp_size is not None and tp_size != mesh.size(tp_dim):
        return f"TE tp_size={tp_size} but mesh dim 'tp' has {mesh.size(tp_dim)} ranks"
    return ""


def _stray(module) -> list:
    from ..fixes.convert.fp8_state import find_unregistered_tensors

    own = [t for t in (*module._parameters.values(), *module._buffers.values()) if t is not None]
    storages = set()
    for t in own:
        local = t.to_local() if is_dtensor(t) else t
        try:
            storages.add(local.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # meta / no storage
            pass
    out = []
    for path, tensor in find_unregistered_tensors(module):
        if isinstance(tensor, nn.Parameter) or tensor.numel() == 0:
            continue
        try:
            if not is_dtensor(tensor) and tensor.untyped_storage().data_ptr() in storages:
                continue  # a view of a parameter or registered buffer (TE quantizers view fp8_meta's tensors)
        except (RuntimeError, NotImplementedError):
            pass
        out.append(".".join(str(p) for p in path))
    return out


def _gemm_weights(module) -> list:
    """(parameter name, parameter, GEMMs per forward) for the GEMM weights held directly by ``module``."""
    if _is_te(module):
        if type(module).__name__ in ("LayerNorm", "RMSNorm"):
            return []
        return [(n, p, 1) for n, p in module.named_parameters(recurse=False) if p.dim() >= 2]
    if isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D":
        w = getattr(module, "weight", None)
        return [("weight", w, 1)] if isinstance(w, torch.Tensor) else []
    if isinstance(module, (nn.modules.conv._ConvNd, nn.Embedding, nn.EmbeddingBag)):
        return []
    # MoE experts fused into 3-D parameters ([experts, in, out]); a router keeping its own 2-D weight
    out = [(n, p, int(p.shape[0])) for n, p in module.named_parameters(recurse=False) if p.dim() == 3]
    if _is_router(module):
        out += [(n, p, 1) for n, p in module.named_parameters(recurse=False) if p.dim() == 2]
    return out


def _is_router(module, name: str = "") -> bool:
    cls = type(module).__name__.lower()
    return "router" in cls or "gate" == cls or name.rsplit(".", 1)[-1] in ("router", "gate")


ROUTER_REASON = ("kept in high precision by design: its GEMM has one output per expert (far below FP8's 16-wide "
                 "tiles in most models) and feeds a top-k whose expert choice FP8 rounding would flip")


def _high_precision_reason(name, module, why_not, skipped=None) -> str:
    if _is_router(module, name):
        if isinstance(module, nn.Linear):
            return "MoE router" + (f": {why_not}" if why_not else "")
        return f"MoE router ({type(module).__name__}, a GEMM on its own 2-D weight): {ROUTER_REASON}"
    if type(module).__name__ == "Conv1D":
        return "transformers Conv1D: not converted to Transformer Engine"
    if moe_experts.is_converted(module):
        return f"MoE experts on Transformer Engine grouped GEMMs: {why_not or 'not in FP8'}"
    if not isinstance(module, nn.Linear) and not _is_te(module):
        return ("MoE experts fused into a 3-D parameter: " + (skipped or "Transformer Engine's Linear takes 2-D weights"
                                                             + (f" ({why_not})" if why_not else "")))
    return why_not or "not in FP8"


def audit(model: nn.Module, accelerator=None) -> AuditReport:
    """Audit ``model`` (prepared by this package or not). ``accelerator``: where this package's prepare left
    its record (``accelerator.accel_fp8_fix``); by default the one remembered for ``model``."""
    setup = getattr(accelerator, "accel_fp8_fix", None) if accelerator is not None else _SETUPS.get(model)
    conversion = getattr(setup, "conversion", None)
    skipped = dict(conversion.skipped) if conversion is not None else {}
    fixes_prepared = setup is not None
    autocast = _forward_under_autocast(model)
    units = _fsdp_units(model)
    registered: dict = {}
    for entry in getattr(setup, "registered_state", None) or ():
        registered.setdefault(entry.module, []).append(entry.buffer)
    modules, coverage = [], Coverage()
    seen_weights = set()
    for name, module in model.named_modules():
        te = _is_te(module)
        params = [_param_audit(f"{name}.{n}" if name else n, p) for n, p in module.named_parameters(recurse=False)]
        link = state_link_of(module)
        fp8_state = registered.get(name) or ([e[1] for e in link.entries] if link is not None else [])
        stray = _stray(module)
        state_names = set(fp8_state)
        kinds = {is_dtensor(t) for t in module._parameters.values() if t is not None}
        kinds |= {is_dtensor(t) for n, t in module._buffers.items() if t is not None and n not in state_names}
        gemms = _gemm_weights(module)
        if not (params or fp8_state or stray or te):
            continue
        experts = moe_experts.is_converted(module)
        fp8 = (te or experts) and bool(gemms) and (autocast or bool(getattr(module, "fp8", False))
                                                  or (experts and _experts_fp8(module)))
        why_not = ""
        if experts and not fp8:
            why_not = ("FP8 off: the forward does not run under Transformer Engine's autocast (stock accelerate "
                       "FSDP2 path, A2)")
        elif not te and not experts and (gemms or isinstance(module, nn.Linear)):
            why_not = skipped.get(name) or (
                "not converted: the model was not prepared by accel_fp8_fix's patched prepare (stock accelerate, "
                "or the fixes off)" if not fixes_prepared else "not converted (not in the conversion report: excluded, or not a type it converts)")
        elif te and gemms and not fp8:
            why_not = ("FP8 off: the forward does not run under Transformer Engine's autocast (stock accelerate "
                       "FSDP2 path, A2)")
        mode = getattr(module, "parallel_mode", None) if te else None
        modules.append(ModuleAudit(
            name=name, type=_type_name(module), is_te=te, fp8=fp8, why_not=why_not, parallel_mode=mode,
            tp_check=_tp_check(module, mode) if te else "", fsdp_unit=units.get(module), params=params,
            fp8_state=list(fp8_state), stray=stray, mixed=len(kinds) > 1, gemm=bool(gemms),
        ))
        for pname, weight, per_forward in gemms:
            if id(weight) in seen_weights:
                continue  # tied weights count once
            seen_weights.add(id(weight))
            numel = weight.numel()
            per_step = per_forward * (3 if weight.requires_grad else 2)  # forward, dgrad, wgrad
            coverage.gemm_params += numel
            coverage.gemms_per_step += per_step
            if fp8:
                coverage.fp8_params += numel
                coverage.fp8_gemms_per_step += per_step
            else:
                label = name if pname == "weight" else (f"{name}.{pname}" if name else pname)
                coverage.high_precision.append((label, _high_precision_reason(name, module, why_not, skipped.get(name))))
    mesh = getattr(setup, "mesh", None)
    ranks = tuple(getattr(setup, "amax_group_ranks", ()) or ()) or None
    return AuditReport(
        modules=modules, coverage=coverage, amax_group_ranks=ranks,
        fp8_enabled=bool(getattr(setup, "fp8_enabled", False)) or (autocast and any(m.fp8 for m in modules)),
        fixes_prepared=fixes_prepared,
        mesh=(f"{tuple(mesh.mesh_dim_names or ())} {tuple(mesh.shape)}" if mesh is not None else None),
    )


COVERAGE_WARNING = "ACCEL_FP8_FIX_COVERAGE_WARNING"
_NAMED_IN_WARNING = 3


def _output_layer(model: nn.Module) -> str | None:
    """Qualified name of the model's output layer (transformers' ``get_output_embeddings()``), else None."""
    get = getattr(model, "get_output_embeddings", None)
    try:
        layer = get() if callable(get) else None
    except Exception:  # noqa: BLE001 - a model whose accessor fails has no output layer we can name
        return None
    return next((name for name, module in model.named_modules() if module is layer), None) if layer is not None else None


def warn_partial_coverage(model: nn.Module, accelerator=None) -> bool:
    """After a prepare that turned FP8 on: one ``RuntimeWarning`` per job (the speaking rank), at the user's
    ``prepare`` line, when GEMMs other than the model's output layer and MoE routers stay in high precision — the
    coverage figure and the first kept GEMMs with their reasons. The output layer and the routers are by design
    (kept high precision, as torchtitan and TE's examples do; in ``audit(model)`` with the reason). ``ACCEL_FP8_FIX_COVERAGE_WARNING=0`` silences
    it. True when it warned."""
    from .. import settings
    from .._log import warn_user

    if settings.get(COVERAGE_WARNING) is False:
        return False
    coverage = audit(model, accelerator).coverage
    output = _output_layer(model)
    kept = [(name, why) for name, why in coverage.high_precision if name != output and ROUTER_REASON not in why]
    by_design = ([f"the output layer {output}"] if output else []) + (
        ["the MoE routers"] if any(ROUTER_REASON in why for _, why in coverage.high_precision) else [])
    if not kept or not coverage.fp8_params:  # nothing kept, or nothing converted (prepare warns about that)
        return False
    named = "; ".join(f"{name}: {why}" for name, why in kept[:_NAMED_IN_WARNING])
    more = f"; and {len(kept) - _NAMED_IN_WARNING} more" if len(kept) > _NAMED_IN_WARNING else ""
    warn_user(f"accel_fp8_fix: FP8 covers {coverage.fp8_param_share:.1%} of the model's GEMM parameters: {len(kept)} "
              f"GEMM weight(s) stay in high precision{' besides ' + ' and '.join(by_design) if by_design else ''} — "
              f"{named}{more}. accel_fp8_fix.audit(model).coverage lists them all; "
              f"{COVERAGE_WARNING}=0 silences this warning.")
    return True
