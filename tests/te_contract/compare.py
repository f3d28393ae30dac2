"""Compare TE's extracted contract (:mod:`.extract`) with the emulation's (:mod:`.emulated`).

Each ``check_*`` returns a :class:`Report`: ``failures`` (drift the emulation must not have) and
``notes`` (differences worth knowing that do not fail). Every message names the TE version and the
exact thing that drifted, e.g. ``TE 2.20.2 Linear.__init__ has parameter 'foo' (default None) that
the emulation lacks``.

The expectation tables below say what is held against which TE version.

``python tests/te_contract/compare.py [2.x-VERSION [1.x-VERSION]]`` prints the full report.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence

# ---------------------------------------------------------------------------------------------
# Expectations -- newest TE 2.x (the release the emulation imitates)
# ---------------------------------------------------------------------------------------------

# The first N constructor parameters must be the emulation's first N, in the same order, and
# passable positionally (te.Linear(in_features, out_features); te.LayerNorm(hidden, eps)).
LEADING_POSITIONAL = {"Linear": 2, "LayerNormLinear": 2, "LayerNorm": 2, "RMSNorm": 2}

# Constructor parameters whose default must equal TE's (when TE's default is a literal).
# Other parameters need only exist; a differing default is a note.
CHECKED_DEFAULTS = (
    "bias", "return_bias", "params_dtype", "tp_group", "tp_size", "parallel_mode", "sequence_parallel",
    "fuse_wgrad_accumulation", "parameters_split", "get_rng_state_tracker", "rng_tracker_name",
    "init_method", "eps", "zero_centered_gamma", "normalization", "return_layernorm_output",
    "return_layernorm_output_gathered", "delay_wgrad_compute", "save_original_input",
    "symmetric_ar_type", "name", "normalized_shape", "hidden_size",
)

# fp8_meta keys the emulation must have when TE has them (at construction if TE sets them in
# __init__, after one FP8 forward otherwise). Other TE keys it lacks are notes.
FP8_META_REQUIRED = ("recipe", "fp8_group", "scaling_fwd", "scaling_bwd", "fp8_checkpoint", "num_gemms")

# Attributes a constructed emulated module must have, for each class whose TE constructor sets
# them (Linear/LayerNormLinear set all of the TransformerEngineBaseModule ones; TE 2.x's
# LayerNorm/RMSNorm are ops-based and set only a few). Other TE attributes it lacks are notes.
MODULE_ATTRIBUTES_REQUIRED = (
    "tp_group", "tp_group_initialized", "tp_size", "parallel_mode", "sequence_parallel",
    "fp8", "fp8_initialized", "fp8_calibration", "fp8_parameters", "fp8_meta",
    "fp8_meta_tensors_initialized", "quantizers", "primary_weights_in_fp8",
    "preserve_high_precision_init_val", "fsdp_wrapped", "fsdp_group", "param_init_meta",
    "activation_dtype", "wgrad_store", "name", "in_features", "out_features", "use_bias",
    "return_bias", "apply_bias", "fuse_wgrad_accumulation", "weight_names", "bias_names",
    "eps", "zero_centered_gamma", "normalization", "return_layernorm_output",
)

# ---------------------------------------------------------------------------------------------
# Expectations -- TE 1.x: only what the emulation claims to keep from 1.x
# ---------------------------------------------------------------------------------------------
#
#   what                      | held against the 1.x source
#   --------------------------+---------------------------------------------------------------
#   fp8_autocast              | identical signature: names, order, kinds, literal defaults
#   DelayedScaling fields     | every 1.x field present with the 1.x literal default,
#                             |   except the ones TE 2.x removed (V1_FIELDS_DROPPED below)
#   Format members            | every 1.x member present, same max_fwd / max_bwd
#
V1_CHECKS = ("fp8_autocast", "DelayedScaling", "Format")
# 1.x fields that TE 2.x dropped; the emulation (a 2.x emulation) need not accept them.
V1_FIELDS_DROPPED = {"DelayedScaling": ("interval", "override_linear_precision")}


@dataclasses.dataclass
class Report:
    failures: List[str] = dataclasses.field(default_factory=list)
    notes: List[str] = dataclasses.field(default_factory=list)

    def extend(self, other: "Report") -> "Report":
        self.failures += other.failures
        self.notes += other.notes
        return self

    def text(self) -> str:
        lines = [f"FAIL: {m}" for m in self.failures] + [f"note: {m}" for m in self.notes]
        return "\n".join(lines) or "(no differences)"


def _fmt_default(p: Dict[str, Any]) -> str:
    if not p.get("has_default"):
        return "required"
    return f"default {p.get('default_src')}"


def _same_default(te: Dict[str, Any], emu: Dict[str, Any]) -> Optional[bool]:
    """True/False when comparable, None when TE's default is not a literal nor ``Enum.MEMBER``."""
    if te.get("has_default") != emu.get("has_default"):
        return False
    if not te.get("has_default"):
        return True
    if te.get("literal"):
        if not emu.get("literal"):
            return False
        a, b = te["default"], emu["default"]
        return a == b and type(a) is type(b)
    src = te.get("default_src", "")
    if src.count(".") == 1 and src.replace(".", "").replace("_", "").isalnum():  # Format.HYBRID
        return emu.get("default_src") == src
    return None


def _by_name(params: Iterable[Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    return {p["name"]: p for p in params}


# ---------------------------------------------------------------------------------------------


def check_constructor(version: str, name: str, te_sig: Optional[Dict[str, Any]],
                      emu_sig: Optional[Dict[str, Any]]) -> Report:
    r = Report()
    what = f"TE {version} {name}.__init__"
    if te_sig is None:
        r.notes.append(f"TE {version} does not export {name}; nothing to check")
        return r
    if emu_sig is None:
        r.failures.append(f"TE {version} exports {name}; the emulation's transformer_engine.pytorch lacks it")
        return r
    te_params = [p for p in te_sig["params"] if p["kind"] not in ("VAR_POSITIONAL", "VAR_KEYWORD")]
    emu_params = emu_sig["params"]
    emu_named = _by_name(p for p in emu_params if p["kind"] not in ("VAR_POSITIONAL", "VAR_KEYWORD"))
    emu_has_kwargs = any(p["kind"] == "VAR_KEYWORD" for p in emu_params)

    for p in te_params:
        e = emu_named.get(p["name"])
        if e is None:
            r.failures.append(f"{what} has parameter '{p['name']}' ({_fmt_default(p)}) that the emulation lacks")
            continue
        if p["kind"] == "POSITIONAL_OR_KEYWORD" and e["kind"] == "POSITIONAL_ONLY":
            r.failures.append(f"{what} takes '{p['name']}' by keyword; the emulation's is positional-only")
        same = _same_default(p, e)
        if same is False:
            msg = (f"{what} parameter '{p['name']}' has {_fmt_default(p)}; "
                   f"the emulation's has {_fmt_default(e)}")
            (r.failures if p["name"] in CHECKED_DEFAULTS or not p.get("has_default") or not e.get("has_default")
             else r.notes).append(msg)
    for kw in te_sig.get("kwargs_forwarded", []):
        if kw not in emu_named and not emu_has_kwargs:
            r.failures.append(f"{what} accepts '{kw}' (via **kwargs to its base) and the emulation does not")
        elif kw not in emu_named:
            r.notes.append(f"{what} accepts '{kw}' (via **kwargs); the emulation only through **kwargs")

    n = LEADING_POSITIONAL.get(name, 0)
    te_lead = [p["name"] for p in te_params[:n]]
    emu_positional = [p["name"] for p in emu_params if p["kind"] in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")]
    if emu_positional[:n] != te_lead:
        r.failures.append(f"{what} starts with positional parameters {tuple(te_lead)}; "
                          f"the emulation's start with {tuple(emu_positional[:n])}")

    te_names = {p["name"] for p in te_sig["params"]} | set(te_sig.get("kwargs_forwarded", []))
    for e in emu_params:
        if e["kind"] in ("VAR_POSITIONAL", "VAR_KEYWORD") or e["name"] in te_names:
            continue
        if not e.get("has_default"):
            r.failures.append(f"the emulation's {name}.__init__ requires '{e['name']}', which TE {version} does not have")
        else:
            r.notes.append(f"the emulation's {name}.__init__ has extra parameter '{e['name']}' "
                           f"({_fmt_default(e)}) that TE {version} lacks")
    return r


def check_signature(version: str, name: str, te_sig: Optional[Dict[str, Any]],
                    emu_sig: Optional[Dict[str, Any]]) -> Report:
    """Exact signature match (names, order, kinds, comparable defaults)."""
    r = Report()
    if te_sig is None:
        r.notes.append(f"TE {version} has no {name}; nothing to check")
        return r
    if emu_sig is None:
        r.failures.append(f"TE {version} exports {name}; the emulation lacks it")
        return r
    what = f"TE {version} {name}"
    te_named, emu_named = _by_name(te_sig["params"]), _by_name(emu_sig["params"])
    for p in te_sig["params"]:
        e = emu_named.get(p["name"])
        if e is None:
            r.failures.append(f"{what} has parameter '{p['name']}' ({_fmt_default(p)}) that the emulation lacks")
            continue
        if p["kind"] != e["kind"]:
            r.failures.append(f"{what} parameter '{p['name']}' is {p['kind']}; the emulation's is {e['kind']}")
        if _same_default(p, e) is False:
            r.failures.append(f"{what} parameter '{p['name']}' has {_fmt_default(p)}; "
                              f"the emulation's has {_fmt_default(e)}")
    for e in emu_sig["params"]:
        if e["name"] not in te_named:
            r.failures.append(f"the emulation's {name} has parameter '{e['name']}' ({_fmt_default(e)}) "
                              f"that TE {version} lacks")
    te_order = [p["name"] for p in te_sig["params"]]
    emu_order = [p["name"] for p in emu_sig["params"] if p["name"] in te_named]
    if [n for n in te_order if n in emu_named] != emu_order:
        r.failures.append(f"{what} parameter order is {tuple(te_order)}; the emulation's is {tuple(emu_order)}")
    return r


def check_recipe(version: str, name: str, te_rec: Optional[Dict[str, Any]], emu_rec: Optional[Dict[str, Any]],
                 dropped: Sequence[str] = (), check_order: bool = True, check_extra: bool = True) -> Report:
    r = Report()
    if te_rec is None:
        r.notes.append(f"TE {version} has no recipe {name}; nothing to check")
        return r
    if emu_rec is None:
        r.failures.append(f"TE {version} has recipe {name}; the emulation's transformer_engine.common.recipe lacks it")
        return r
    what = f"TE {version} {name}"
    te_fields, emu_fields = te_rec["fields"], _by_name(emu_rec["fields"])
    for f in te_fields:
        e = emu_fields.get(f["name"])
        if e is None:
            if f["name"] in dropped:
                r.notes.append(f"{what} field '{f['name']}' ({_fmt_default(f)}) was dropped in 2.x; "
                               "the emulation does not keep it (as listed in V1_FIELDS_DROPPED)")
            else:
                r.failures.append(f"{what} has field '{f['name']}' ({_fmt_default(f)}) that the emulation lacks")
            continue
        same = _same_default(f, e)
        if same is False:
            r.failures.append(f"{what} field '{f['name']}' has {_fmt_default(f)}; the emulation's has {_fmt_default(e)}")
        elif same is None and e.get("default_src") != f.get("default_src"):
            r.notes.append(f"{what} field '{f['name']}' default is `{f.get('default_src')}`; "
                           f"the emulation's is `{e.get('default_src')}` (not a literal: not compared)")
    te_names = [f["name"] for f in te_fields]
    if check_extra:
        for e in emu_rec["fields"]:
            if e["name"] in te_rec.get("class_attributes", []):
                r.failures.append(
                    f"the emulation's {name} has dataclass field '{e['name']}'; in TE {version} it is a plain "
                    f"class attribute, not a field (TE's {name}(...) does not accept '{e['name']}=')")
            elif e["name"] not in te_names:
                r.failures.append(f"the emulation's {name} has field '{e['name']}' that TE {version} lacks")
    if check_order:
        common_te = [n for n in te_names if n in emu_fields]
        common_emu = [e["name"] for e in emu_rec["fields"] if e["name"] in te_names]
        if common_te != common_emu:
            r.failures.append(f"{what} field order (positional construction) is {tuple(common_te)}; "
                              f"the emulation's is {tuple(common_emu)}")
    for attr in te_rec.get("class_attributes", []):
        if attr not in emu_rec.get("class_attributes", []) and attr not in emu_fields:
            r.notes.append(f"{what} has class attribute '{attr}' that the emulation's {name} lacks")
    return r


def check_format(version: str, te_fmt: Optional[Dict[str, Any]], emu_fmt: Optional[Dict[str, Any]],
                 allow_extra: bool = False) -> Report:
    r = Report()
    if te_fmt is None:
        return r
    if emu_fmt is None:
        r.failures.append(f"TE {version} has recipe.Format; the emulation lacks it")
        return r
    for member, info in te_fmt.items():
        e = emu_fmt.get(member)
        if e is None:
            r.failures.append(f"TE {version} Format has member {member} that the emulation lacks")
            continue
        for attr in ("max_fwd", "max_bwd"):
            if attr in info and e.get(attr) != info[attr]:
                r.failures.append(f"TE {version} Format.{member}.{attr} is {info[attr]}; the emulation's is {e.get(attr)}")
    if not allow_extra:
        for member in emu_fmt:
            if member not in te_fmt:
                r.failures.append(f"the emulation's Format has member {member} that TE {version} lacks")
    return r


def check_fp8_meta(version: str, name: str, te_contract: Dict[str, Any], runtime: Optional[Dict[str, Any]]) -> Report:
    r = Report()
    init = te_contract["fp8_meta"]["init"].get(name)
    if init is None:
        r.notes.append(f"TE {version} {name} keeps no fp8_meta dict; nothing to check")
        return r
    if runtime is None:
        r.failures.append(f"the emulation has no {name} to construct")
        return r
    if "error" in runtime:
        r.failures.append(f"emulated {name}: {runtime['error']}")
        return r
    te_init = set(init["keys"])
    te_all = te_init | set(te_contract["fp8_meta"]["written_keys"])
    emu_init = runtime.get("fp8_meta_init")
    if emu_init is None:
        r.failures.append(f"TE {version} {name} has a plain-dict fp8_meta (made in {init['created_in']}); "
                          f"the emulated module's fp8_meta is {runtime.get('fp8_meta_type')}")
        return r
    for key in sorted(te_init - set(emu_init)):
        (r.failures if key in FP8_META_REQUIRED else r.notes).append(
            f"TE {version} {name} has fp8_meta['{key}'] right after construction ({init['created_in']}); "
            "the emulated module does not")
    if "forward_error" in runtime:
        r.failures.append(f"emulated {name}: {runtime['forward_error']}")
        return r
    after = set(runtime.get("fp8_meta_after_forward") or [])
    for key in sorted(te_all - after):
        where = "; ".join(te_contract["fp8_meta"]["written_keys"].get(key, [init["created_in"]])[:2])
        (r.failures if key in FP8_META_REQUIRED else r.notes).append(
            f"TE {version} writes fp8_meta['{key}'] ({where}); the emulated {name} lacks it after an FP8 forward")
    for key in sorted(after - te_all):
        r.notes.append(f"the emulated {name} has fp8_meta['{key}'], which TE {version} never writes")
    return r


def check_attributes(version: str, name: str, te_sig: Optional[Dict[str, Any]], runtime: Optional[Dict[str, Any]]) -> Report:
    r = Report()
    if te_sig is None:
        return r
    if runtime is None:
        r.failures.append(f"the emulation has no {name} to construct")
        return r
    if "error" in runtime:
        r.failures.append(f"emulated {name}: {runtime['error']}")
        return r
    have = set(runtime["attributes"])
    for attr, where in te_sig["init_attributes"].items():
        if attr in have:
            continue
        msg = f"TE {version} {name} sets self.{attr} in {where}; the emulated {name} has no '{attr}'"
        (r.failures if attr in MODULE_ATTRIBUTES_REQUIRED else r.notes).append(msg)
    return r


# ---------------------------------------------------------------------------------------------


def full_report(te2: Dict[str, Any], emu: Dict[str, Any], te1: Optional[Dict[str, Any]] = None) -> Report:
    v2 = te2["version"]
    r = Report()
    for name in te2["modules"]:
        r.extend(check_constructor(v2, name, te2["modules"][name], emu["modules"].get(name)))
        r.extend(check_attributes(v2, name, te2["modules"][name], emu["runtime"].get(name)))
        r.extend(check_fp8_meta(v2, name, te2, emu["runtime"].get(name)))
    for name in te2["functions"]:
        r.extend(check_signature(v2, name, te2["functions"][name], emu["functions"].get(name)))
    for name in te2["recipes"]:
        r.extend(check_recipe(v2, name, te2["recipes"][name], emu["recipes"].get(name)))
    r.extend(check_format(v2, te2["format"], emu["format"]))
    if te1 is not None:
        r.extend(v1_report(te1, emu))
    return r


def v1_report(te1: Dict[str, Any], emu: Dict[str, Any]) -> Report:
    v1 = te1["version"]
    r = Report()
    r.extend(check_signature(v1, "fp8_autocast", te1["functions"]["fp8_autocast"], emu["functions"].get("fp8_autocast")))
    r.extend(check_recipe(v1, "DelayedScaling", te1["recipes"]["DelayedScaling"], emu["recipes"].get("DelayedScaling"),
                          dropped=V1_FIELDS_DROPPED["DelayedScaling"], check_order=False, check_extra=False))
    r.extend(check_format(v1, te1["format"], emu["format"], allow_extra=True))
    return r


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from te_contract import emulated, extract, wheels

    versions = argv or ["2.20.2", "1.13.0"]
    trees = [extract.extract_contract(extract.SourceTree.from_archive(wheels.obtain_wheel(v))) for v in versions]
    emu = emulated.load()
    try:
        emu_c = emulated.emulated_contract(emu)
    finally:
        emu.close()
    rep = full_report(trees[0], emu_c, trees[1] if len(trees) > 1 else None)
    print(rep.text())
    return 1 if rep.failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
