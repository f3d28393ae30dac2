"""``accel-fp8-fix doctor --launch CONFIG.yaml``: will this accelerate config run FP8 with the fixes?

Reads the config file ``accelerate launch --config_file`` would read and answers before any GPU is paid for:
the flag present, the installed versions in a supported window, ``mixed_precision: fp8`` with the TE
backend, FSDP version 2, the parallelism sizes against the process count, Transformer Engine installed.
Each failed check carries the exact line to add or change. Imports neither torch nor accelerate.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field

__all__ = ["Check", "LaunchVerdict", "check_launch_config"]

SIZE_KEYS = ("dp_replicate", "dp_shard", "tp", "cp", "sp")


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""  # the exact line(s) to add or change, for a failed check
    blocking: bool = True  # a failed non-blocking check is a warning


@dataclass
class LaunchVerdict:
    path: str
    checks: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks if c.blocking)

    @property
    def failed(self) -> list:
        return [c.name for c in self.checks if not c.ok and c.blocking]

    def __str__(self) -> str:
        head = ("WILL RUN Transformer Engine FP8 with accel_fp8_fix" if self.ok else
                "WILL NOT run FP8 with accel_fp8_fix: " + ", ".join(self.failed))
        lines = [f"accel_fp8_fix doctor --launch {self.path}", f"  verdict: {head}"]
        for c in self.checks:
            mark = "ok  " if c.ok else ("FAIL" if c.blocking else "warn")
            lines.append(f"  [{mark}] {c.name}: {c.detail}")
            if not c.ok and c.fix:
                lines.extend(f"         {line}" for line in c.fix.splitlines())
        return "\n".join(lines)


class ConfigFileError(ValueError):
    """The config file cannot be parsed: ``line`` and ``column`` (1-based) where the parser stopped."""

    def __init__(self, path: str, line, column, problem: str):
        where = f"{path}:{line}:{column}" if line is not None else path
        super().__init__(f"{where}: {problem}")
        self.path, self.line, self.column, self.problem = path, line, column, problem


def _load(path: str) -> dict:
    import yaml  # accelerate's own dependency (its config files are YAML; JSON is YAML too)

    with open(path) as fh:
        try:
            data = yaml.safe_load(fh) or {}
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
            parts = (getattr(exc, "context", None), getattr(exc, "problem", None))
            problem = " ".join(str(p).replace("\n", " ") for p in parts if p)
            raise ConfigFileError(path, mark.line + 1 if mark else None, mark.column + 1 if mark else None,
                                  f"not valid YAML: {problem or type(exc).__name__}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not an accelerate config (expected a mapping at the top level)")
    return data


def _int(value, default: int = 1) -> int:
    try:
        return int(value) if value is not None else default
    except (TypeError, ValueError):
        return default


def check_launch_config(path: str, versions: dict | None = None, environ: dict | None = None) -> LaunchVerdict:
    """The verdict for the accelerate config file at ``path`` (``versions``/``environ``: for tests)."""
    from .. import _api

    environ = dict(os.environ if environ is None else environ)
    cfg = _load(path)
    verdict = LaunchVerdict(path)
    add = verdict.checks.append

    # mixed precision and backend
    mp = str(cfg.get("mixed_precision", "no")).lower()
    add(Check("mixed_precision", mp == "fp8", f"mixed_precision: {mp}", "mixed_precision: fp8"))
    fp8 = cfg.get("fp8_config") or {}
    backend = str(fp8.get("backend", "")).upper()
    add(Check("FP8 backend", backend == "TE", f"fp8_config.backend: {backend or 'not set'} (the fixes are for TE)",
              "fp8_config:\n  backend: TE"))

    # settings: every registered variable set in this environment, read as the run reads it
    from .. import settings

    for setting, exc in settings.check(environ):
        if setting.config_key is None:  # fp8_config keys: the activation and recipe checks below
            add(Check(f"setting {setting.name}", False, str(exc).removeprefix("accel_fp8_fix: "),
                      f"export {setting.name}={setting.example()}  (or unset it)"))

    # the flag (or another way in): the value the workers get (ACCELERATE_FP8_ACCEL_FP8_FIX), parsed as they parse it
    exported = {**{k: v for k, v in environ.items() if k.startswith(settings.FP8_CONFIG_PREFIX)},
                **settings.exported_fp8_env(fp8)}  # the config file's keys win, as in accelerate launch
    flag_setting = settings.REGISTRY["ACCELERATE_FP8_ACCEL_FP8_FIX"]
    try:
        flag_on = bool(flag_setting.parse(exported.get(flag_setting.name)))
        flag_error = None
    except ValueError as exc:
        flag_on, flag_error = False, exc
    try:
        env_on = settings.get("ACCEL_FP8_FIX", environ)
    except ValueError:
        env_on = None  # reported by the settings check above
    if flag_error is not None:
        add(Check("activation", False, str(flag_error).removeprefix("accel_fp8_fix: ") + "; the workers' start-up "
                  "import fails on it, so the fixes stay off", "fp8_config:\n  accel_fp8_fix: true"))
    elif env_on is False:
        add(Check("activation", False, "ACCEL_FP8_FIX=0 in this environment turns every activation off",
                  "unset ACCEL_FP8_FIX (or export ACCEL_FP8_FIX=1)"))
    elif flag_on:
        add(Check("activation", True, "fp8_config.accel_fp8_fix: true (accelerate launch exports it to every worker)"))
    elif env_on:
        add(Check("activation", True, "ACCEL_FP8_FIX=1 in this environment (the config file has no flag)"))
    else:
        add(Check("activation", False, "no fp8_config.accel_fp8_fix flag: stock accelerate would run (unless the "
                  "script imports accel_fp8_fix before Accelerator())",
                  "fp8_config:\n  accel_fp8_fix: true"))

    # the recipe and its settings: the check Accelerator() and prepare run (fixes/recipes.py), on the variables
    # accelerate launch exports (the config file's fp8_config over this environment's ACCELERATE_FP8_*)
    add(_recipe_check(exported))

    # versions
    selection = _api.choose_patch_set("fix", versions)
    add(Check("versions", selection.supported,
              f"patch set {selection.patch_set.name}: {selection.reason}" if selection.supported else selection.reason,
              "install versions inside a supported window (accel-fp8-fix doctor lists them)"))

    # Transformer Engine installed (not imported: that needs the GPU this check runs before)
    te_version = (versions or {}).get("transformer-engine") if versions is not None else _te_version()
    try:
        rehearsal = bool(settings.get("ACCEL_FP8_FIX_EMULATE_TE", environ))
    except ValueError:
        rehearsal = False  # reported by the settings check
    if te_version:
        detail = f"transformer-engine {te_version} installed" + (
            " (rehearsal: its Python over the CPU kernel shim)" if rehearsal else "")
        add(Check("Transformer Engine", True, detail))
    else:
        add(Check("Transformer Engine", False, "transformer_engine is not installed in this environment",
                  "pip install transformer-engine[pytorch]"))

    # distributed type and FSDP version
    dist_type = str(cfg.get("distributed_type", "NO")).upper()
    fsdp = cfg.get("fsdp_config") or {}
    pc = cfg.get("parallelism_config") or {}
    sizes = {k: _int(pc.get(f"parallelism_config_{k}_size")) for k in SIZE_KEYS}
    if dist_type == "FSDP":
        version = _int(fsdp.get("fsdp_version"), 1)
        add(Check("FSDP version", version == 2, f"fsdp_config.fsdp_version: {version}",
                  "fsdp_config:\n  fsdp_version: 2"))
    elif sizes["tp"] > 1:
        add(Check("parallelism", True, f"distributed_type {dist_type} with tp {sizes['tp']} (TP without FSDP)"))
    else:
        add(Check("parallelism", False, f"distributed_type {dist_type}: the fixes act on FSDP2 and/or TP (plain DDP / "
                  "one process runs stock accelerate's TE path)", "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2",
                  blocking=False))

    # parallelism sizes vs processes
    processes = _int(cfg.get("num_processes"), 1)
    total = 1
    for v in sizes.values():
        total *= v
    product = " x ".join(f"{k} {v}" for k, v in sizes.items() if v > 1) or "all 1"
    if total == 1:
        add(Check("process count", True, f"num_processes {processes}, no parallelism_config sizes (data parallel over "
                  "every process)"))
    elif total == processes:
        add(Check("process count", True, f"num_processes {processes} = {product}"))
    else:
        fix = f"num_processes: {total}"
        if sizes["dp_shard"] > 1 and processes % (total // sizes["dp_shard"]) == 0:
            fix += f"\n(or parallelism_config_dp_shard_size: {processes // (total // sizes['dp_shard'])})"
        add(Check("process count", False, f"num_processes {processes} but the parallelism sizes multiply to {total} "
                  f"({product}); accelerate refuses a mismatch at Accelerator()", fix))
    if dist_type == "FSDP" and total > 1 and sizes["dp_shard"] == 1 and sizes["cp"] == 1:
        add(Check("FSDP shard dim", False, "FSDP with parallelism sizes but dp_shard 1 and cp 1: nothing for FSDP to "
                  "shard across", "parallelism_config_dp_shard_size: 2  (at least 2)"))

    if cfg.get("use_cpu") and not rehearsal:
        add(Check("device", False, "use_cpu: true without ACCEL_FP8_FIX_EMULATE_TE=1: Transformer Engine needs a GPU",
                  "export ACCEL_FP8_FIX_EMULATE_TE=1  (the CPU rehearsal), or use_cpu: false on GPUs", blocking=False))
    return verdict


def _recipe_check(environ: dict) -> Check:
    from ..fixes import recipes

    try:
        choice, setting, fields = recipes.settings_from_env(environ)
        mxfp8 = bool(fields.pop("use_mxfp8_block_scaling", False))
        fields.pop("use_autocast_during_eval", None)
        name, setting = recipes.check_settings(choice, setting, fields, mxfp8)
    except recipes.RecipeSettingError as exc:
        return Check("FP8 recipe", False, str(exc).removeprefix("accel_fp8_fix: "), exc.fix)
    except ValueError as exc:  # an unknown recipe name (the settings registry's message)
        return Check("FP8 recipe", False, str(exc).removeprefix("accel_fp8_fix: "),
                     f"recipe: delayed  (one of {', '.join(recipes.RECIPES)})")
    class_name = recipes.RECIPES[name][0]
    detail = f"{name} ({class_name}, {setting})"
    if fields:
        detail += ": " + ", ".join(f"{k}={v}" for k, v in sorted(fields.items()))
    return Check("FP8 recipe", True, detail + " (TE and the GPU are asked at prepare)")


def _te_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("transformer-engine", "transformer_engine"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None if importlib.util.find_spec("transformer_engine") is None else "unknown"
