"""Read the same contract as :mod:`.extract` from ``accel_fp8_fix.emulation`` (in-process, on CPU).

Signatures come from ``inspect.signature``; module attributes and ``fp8_meta`` keys from really
constructing each emulated module and running one FP8 forward under the emulated ``fp8_autocast``
with ``DelayedScaling``.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import inspect
import json
import traceback
import warnings
from typing import Any, Dict, List, Optional

from .extract import AUTOCAST_FUNCTIONS, MODULE_CLASSES, RECIPE_CLASSES

# (constructor args, input shape) per module: FP8 GEMMs want dims divisible by 16.
_BUILD = {
    "Linear": ((32, 32), (16, 32)),
    "LayerNormLinear": ((32, 32), (16, 32)),
    "LayerNorm": ((32,), (16, 32)),
    "RMSNorm": ((32,), (16, 32)),
}


class EmulationMissing(RuntimeError):
    """``accel_fp8_fix.emulation`` (or its ``install``) does not exist in this tree yet."""


@dataclasses.dataclass
class Emulation:
    te: Any  # transformer_engine.pytorch (emulated)
    recipe: Any  # transformer_engine.common.recipe (emulated)
    installed_here: bool  # we called install() and should uninstall() afterwards
    package: Any  # accel_fp8_fix.emulation

    def close(self) -> None:
        if self.installed_here and hasattr(self.package, "uninstall"):
            self.package.uninstall()


def load() -> Emulation:
    """Install the emulation's import aliases and import ``transformer_engine.pytorch`` through them.

    If a real TE is importable, ``install()`` refuses to shadow it; then the emulation's own modules
    (``accel_fp8_fix.emulation.te.*``) are imported directly, which leaves the real TE alone.
    """
    try:
        pkg = importlib.import_module("accel_fp8_fix.emulation")
    except ModuleNotFoundError as exc:
        if exc.name in ("accel_fp8_fix.emulation", "accel_fp8_fix"):
            raise EmulationMissing(f"cannot import accel_fp8_fix.emulation: {exc}") from exc
        raise
    if not hasattr(pkg, "install"):
        raise EmulationMissing("accel_fp8_fix.emulation has no install() yet")
    installed_here = False
    try:
        already = bool(getattr(pkg, "is_installed", lambda: False)())
        pkg.install()
        installed_here = not already
        te = importlib.import_module("transformer_engine.pytorch")
        recipe = importlib.import_module("transformer_engine.common.recipe")
    except RuntimeError as exc:
        if "real Transformer Engine" not in str(exc):
            raise
        te = importlib.import_module("accel_fp8_fix.emulation.te.pytorch")
        recipe = importlib.import_module("accel_fp8_fix.emulation.te.common.recipe")
    return Emulation(te=te, recipe=recipe, installed_here=installed_here, package=pkg)


# --------------------------------------------------------------------------------------------


def value_repr(value: Any) -> Dict[str, Any]:
    """A default value in the extractor's terms: literal JSON value, or its source-like text."""
    if isinstance(value, enum.Enum):
        return {"literal": False, "default": None, "default_src": f"{type(value).__name__}.{value.name}"}
    try:
        json.dumps(value)
        literal = isinstance(value, (type(None), bool, int, float, str, list, dict))
    except (TypeError, ValueError):
        literal = False
    if isinstance(value, tuple):
        literal = False
    return {"literal": literal, "default": value if literal else None, "default_src": repr(value)}


def signature_params(obj: Any) -> List[Dict[str, Any]]:
    sig = inspect.signature(obj)
    out = []
    for p in sig.parameters.values():
        entry: Dict[str, Any] = {"name": p.name, "kind": p.kind.name, "has_default": p.default is not p.empty}
        if p.default is not p.empty:
            entry.update(value_repr(p.default))
        out.append(entry)
    return out


def recipe_fields(cls: Any) -> List[Dict[str, Any]]:
    if dataclasses.is_dataclass(cls):
        out = []
        for f in dataclasses.fields(cls):
            entry: Dict[str, Any] = {"name": f.name}
            if f.default is not dataclasses.MISSING:
                entry.update({"has_default": True, **value_repr(f.default)})
            elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                entry.update({"has_default": True, "literal": False, "default": None, "default_src": "<factory>"})
            else:
                entry["has_default"] = False
            out.append(entry)
        return out
    return [p for p in signature_params(cls) if p["kind"] not in ("VAR_POSITIONAL", "VAR_KEYWORD")]


def format_members(fmt: Any) -> Dict[str, Dict[str, Any]]:
    out = {}
    for name, member in fmt.__members__.items():
        info: Dict[str, Any] = {"value_src": repr(member.value)}
        for attr in ("max_fwd", "max_bwd"):
            if hasattr(member.value, attr):
                info[attr] = getattr(member.value, attr)
        out[name] = info
    return out


def build_and_run(emu: Emulation, name: str) -> Dict[str, Any]:
    """Construct the emulated module on CPU, run one FP8 (DelayedScaling) forward; what it shows."""
    import torch

    cls = getattr(emu.te, name)
    args, in_shape = _BUILD[name]
    params = inspect.signature(cls).parameters
    kwargs: Dict[str, Any] = {}
    if "params_dtype" in params:
        kwargs["params_dtype"] = torch.float32
    if "device" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
        kwargs["device"] = "cpu"
    result: Dict[str, Any] = {"build": f"{name}{args!r} with {sorted(kwargs)}"}
    try:
        mod = cls(*args, **kwargs)
    except Exception:
        result["error"] = "construction failed:\n" + traceback.format_exc(limit=4)
        return result
    result["attributes"] = sorted(set(vars(mod)) | {a for a in dir(mod) if not a.startswith("__")})
    meta = getattr(mod, "fp8_meta", None)
    result["fp8_meta_init"] = sorted(meta) if isinstance(meta, dict) else None
    result["fp8_meta_type"] = type(meta).__name__ if meta is not None else None
    try:
        x = torch.randn(*in_shape)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # TE 2.x deprecates fp8_autocast, too
            with emu.te.fp8_autocast(enabled=True, fp8_recipe=emu.recipe.DelayedScaling()):
                out = mod(x)
        if isinstance(out, (tuple, list)):
            out = out[0]
        result["output_shape"] = list(out.shape)
    except Exception:
        result["forward_error"] = "FP8 forward failed:\n" + traceback.format_exc(limit=4)
    # TE sets some attributes only on the first forward (init_fp8_metadata: fp8, fp8_parameters...)
    result["attributes"] = sorted(set(result["attributes"]) | set(vars(mod)))
    meta = getattr(mod, "fp8_meta", None)
    result["fp8_meta_after_forward"] = sorted(meta) if isinstance(meta, dict) else None
    return result


def emulated_contract(emu: Emulation, run_modules: bool = True) -> Dict[str, Any]:
    """The emulation's contract, shaped like :func:`.extract.extract_contract`'s (plus ``runtime``)."""
    contract: Dict[str, Any] = {"modules": {}, "functions": {}, "recipes": {}, "format": None, "runtime": {}}
    for name in MODULE_CLASSES:
        cls = getattr(emu.te, name, None)
        contract["modules"][name] = None if cls is None else {"params": signature_params(cls)}
        if cls is not None and run_modules:
            contract["runtime"][name] = build_and_run(emu, name)
    for name in AUTOCAST_FUNCTIONS:
        obj = getattr(emu.te, name, None)
        contract["functions"][name] = None if obj is None else {"params": signature_params(obj)}
    for name in RECIPE_CLASSES:
        cls = getattr(emu.recipe, name, None)
        contract["recipes"][name] = None if cls is None else {
            "fields": recipe_fields(cls),
            "class_attributes": sorted(a for a in dir(cls) if not a.startswith("__")),
        }
    fmt = getattr(emu.recipe, "Format", None)
    contract["format"] = format_members(fmt) if fmt is not None else None
    return contract


def emulated_version(emu: Emulation) -> Optional[str]:
    return getattr(emu.package, "EMULATED_TE_VERSION", None)
