"""``accel-fp8-fix doctor --launch CONFIG.yaml``: will this accelerate config run FP8 with the fixes?

Reads the config file ``accelerate launch --config_file`` would read and answers before any GPU is paid for:
the flag present, the installed versions in a supported window, ``mixed_precision: fp8`` with the TE
backend, FSDP version 2, the parallelism sizes against the process count, Transformer Engine installed.
Each failed check carries the exact line to add or change. Imports neither torch nor accelerate.
"""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass, field

from ..fixes.start.layout import SIZE_KEYS, refused_layout, unknown_sizes, unknown_sizes_message

__all__ = ["Check", "LaunchVerdict", "check_launch_config"]


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
    from .. import _api, settings

    environ = dict(os.environ if environ is None else environ)
    cfg = _load(path)
    verdict = LaunchVerdict(path)
    fp8 = cfg.get("fp8_config") or {}
    # the value the workers get for each fp8_config key (ACCELERATE_FP8_*): the config file's keys win over this
    # environment's, as in accelerate launch
    exported = {**{k: v for k, v in environ.items() if k.startswith(settings.FP8_CONFIG_PREFIX)},
                **settings.exported_fp8_env(fp8)}
    try:
        rehearsal = bool(settings.get(settings.REHEARSAL, environ))
    except ValueError:
        rehearsal = False  # reported by the settings check
    verdict.checks += _precision_checks(cfg, fp8)
    verdict.checks += _settings_checks(environ)
    verdict.checks.append(_activation_check(exported, environ))
    # the recipe and its settings: the check Accelerator() and prepare run (fixes/start/recipes.py)
    verdict.checks.append(_recipe_check(exported))
    all_gather = _all_gather_check(cfg, exported)
    if all_gather is not None:
        verdict.checks.append(all_gather)
    selection = _api.choose_patch_set("fix", versions)
    verdict.checks.append(Check(
        "versions", selection.supported,
        f"patch set {selection.patch_set.name}: {selection.reason}" if selection.supported else selection.reason,
        "install versions inside a supported window (accel-fp8-fix doctor lists them)"))
    verdict.checks.append(_te_check(versions, rehearsal))
    verdict.checks += _layout_checks(cfg)
    cp = _cp_check(cfg, exported)
    if cp is not None:
        verdict.checks.append(cp)
    if cfg.get("use_cpu") and not rehearsal:
        verdict.checks.append(Check(
            "device", False, f"use_cpu: true without {settings.REHEARSAL}=1: Transformer Engine needs a GPU",
            f"export {settings.REHEARSAL}=1  (the CPU rehearsal), or use_cpu: false on GPUs", blocking=False))
    return verdict


def _precision_checks(cfg: dict, fp8: dict) -> list[Check]:
    mp = str(cfg.get("mixed_precision", "no")).lower()
    backend = str(fp8.get("backend", "")).upper()
    return [
        Check("mixed_precision", mp == "fp8", f"mixed_precision: {mp}", "mixed_precision: fp8"),
        Check("FP8 backend", backend == "TE", f"fp8_config.backend: {backend or 'not set'} (the fixes are for TE)",
              "fp8_config:\n  backend: TE"),
    ]


def _settings_checks(environ: dict) -> list[Check]:
    """Every registered variable set in this environment, read as the run reads it (fp8_config keys: the
    activation and recipe checks)."""
    from .. import settings

    return [Check(f"setting {setting.name}", False, str(exc).removeprefix("accel_fp8_fix: "),
                  f"export {setting.name}={setting.example()}  (or unset it)")
            for setting, exc in settings.check(environ) if setting.config_key is None]


def _activation_check(exported: dict, environ: dict) -> Check:
    """The flag (or another way in): ACCELERATE_FP8_ACCEL_FP8_FIX as the workers get and parse it."""
    from .. import settings

    flag_setting = settings.REGISTRY["ACCELERATE_FP8_ACCEL_FP8_FIX"]
    try:
        flag_on, flag_error = bool(flag_setting.parse(exported.get(flag_setting.name))), None
    except ValueError as exc:
        flag_on, flag_error = False, exc
    try:
        env_on = settings.get("ACCEL_FP8_FIX", environ)
    except ValueError:
        env_on = None  # reported by the settings check
    if flag_error is not None:
        return Check("activation", False, str(flag_error).removeprefix("accel_fp8_fix: ") + "; the workers' start-up "
                     "import fails on it, so the fixes stay off", "fp8_config:\n  accel_fp8_fix: true")
    if env_on is False:
        return Check("activation", False, "ACCEL_FP8_FIX=0 in this environment turns every activation off",
                     "unset ACCEL_FP8_FIX (or export ACCEL_FP8_FIX=1)")
    if flag_on:
        return Check("activation", True, "fp8_config.accel_fp8_fix: true (accelerate launch exports it to every worker)")
    if env_on:
        return Check("activation", True, "ACCEL_FP8_FIX=1 in this environment (the config file has no flag)")
    return Check("activation", False, "no fp8_config.accel_fp8_fix flag: stock accelerate would run (unless the "
                 "script imports accel_fp8_fix before Accelerator())", "fp8_config:\n  accel_fp8_fix: true")


def _te_check(versions: dict | None, rehearsal: bool) -> Check:
    """Transformer Engine installed (not imported: that needs the GPU this check runs before)."""
    te_version = (versions or {}).get("transformer-engine") if versions is not None else _te_version()
    if te_version:
        detail = f"transformer-engine {te_version} installed" + (
            " (rehearsal: its Python over the CPU kernel shim)" if rehearsal else "")
        return Check("Transformer Engine", True, detail)
    return Check("Transformer Engine", False, "transformer_engine is not installed in this environment",
                 "pip install transformer-engine[pytorch]")


def _layout_checks(cfg: dict) -> list[Check]:
    """Distributed type, FSDP version, and the parallelism sizes against the process count."""
    checks = []
    dist_type = str(cfg.get("distributed_type", "NO")).upper()
    fsdp = cfg.get("fsdp_config") or {}
    pc = cfg.get("parallelism_config") or {}
    sizes = {k: _int(pc.get(f"parallelism_config_{k}_size")) for k in SIZE_KEYS}
    if dist_type == "FSDP":
        version = _int(fsdp.get("fsdp_version"), 1)
        checks.append(Check("FSDP version", version == 2, f"fsdp_config.fsdp_version: {version}",
                            "fsdp_config:\n  fsdp_version: 2"))
    elif sizes["tp"] > 1:
        checks.append(Check("parallelism", True, f"distributed_type {dist_type} with tp {sizes['tp']} (TP without FSDP)"))
    else:
        checks.append(Check("parallelism", False, f"distributed_type {dist_type}: the fixes act on FSDP2 and/or TP "
                            "(plain DDP / one process runs stock accelerate's TE path)",
                            "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2", blocking=False))
    checks.append(_process_count_check(_int(cfg.get("num_processes"), 1), sizes))
    unknown = unknown_sizes({key[len("parallelism_config_"):-len("_size")]: value for key, value in pc.items()
                             if key.startswith("parallelism_config_") and key.endswith("_size")})
    if unknown:
        checks.append(Check("parallelism dimensions", False,
                            unknown_sizes_message(unknown, "parallelism_config_{key}_size").removeprefix("accel_fp8_fix: "),
                            "\n".join(f"parallelism_config_{key}_size: 1" for key in unknown)))

    fp8 = str(cfg.get("mixed_precision", "no")).lower() == "fp8"
    # dp_replicate x tp / cp without dp_shard: refused at ParallelismConfig() (by this package at Accelerator() for
    # an FP8 run of dp_replicate x tp, which accelerate 1.16 takes)
    refusal = refused_layout(sizes, fsdp=None, fp8=fp8)
    if refusal is not None:
        who = "this package refuses" if "accelerate 1.16 takes" in refusal[0] else "accelerate refuses"
        checks.append(Check("layout", False, f"{refusal[0]}; {who} it at Accelerator()", "use " + refusal[1]))
    total = math.prod(sizes.values())
    if dist_type == "FSDP" and total > 1 and sizes["dp_shard"] == 1 and sizes["cp"] == 1:
        checks.append(Check("FSDP shard dim", False, "FSDP with parallelism sizes but dp_shard 1 and cp 1: nothing "
                            "for FSDP to shard across", "parallelism_config_dp_shard_size: 2  (at least 2)"))
    return checks


def _cp_check(cfg: dict, environ: dict):
    """With ``parallelism_config_cp_size > 1``: the sequence multiple every CP step needs (A23, fixes/step/context_parallel.py)
    for the configured recipe — what the config says; the lengths themselves are checked at each step. None without
    CP."""
    from ..fixes.start import recipes
    from ..fixes.step.context_parallel import pad_multiple, token_multiple_of

    cp = _int((cfg.get("parallelism_config") or {}).get("parallelism_config_cp_size"))
    if cp <= 1:
        return None
    fp8 = str(cfg.get("mixed_precision", "no")).lower() == "fp8"
    multiple, why = pad_multiple(cp, 1), f"cp {cp} x 2"
    if fp8:
        try:  # as the recipe check reads it
            choice, setting, fields = recipes.settings_from_env(environ)
            mxfp8 = bool(fields.pop("use_mxfp8_block_scaling", False))
            fields.pop("use_autocast_during_eval", None)
            name = recipes.check_settings(choice, setting, fields, mxfp8)[0]
        except ValueError:  # reported by the recipe check
            name = "delayed"
        tokens = token_multiple_of(recipes.RECIPES[name][0])
        multiple, why = pad_multiple(cp, tokens), f"cp {cp} x the {name} recipe's FP8 token multiple {tokens}"
    return Check("context parallelism", True,
                 f"cp {cp}: pad every sequence to a multiple of {multiple} ({why}), pass input_ids, shift_labels and "
                 "position_ids as maybe_context_parallel buffers and no attention mask (README 'Context parallelism')")


def _process_count_check(processes: int, sizes: dict) -> Check:
    total = math.prod(sizes.values())
    product = " x ".join(f"{k} {v}" for k, v in sizes.items() if v > 1) or "all 1"
    if total == 1:
        return Check("process count", True, f"num_processes {processes}, no parallelism_config sizes (data parallel "
                     "over every process)")
    if total == processes:
        return Check("process count", True, f"num_processes {processes} = {product}")
    fix = f"num_processes: {total}"
    if sizes["dp_shard"] > 1 and processes % (total // sizes["dp_shard"]) == 0:
        fix += f"\n(or parallelism_config_dp_shard_size: {processes // (total // sizes['dp_shard'])})"
    return Check("process count", False, f"num_processes {processes} but the parallelism sizes multiply to {total} "
                 f"({product}); accelerate refuses a mismatch at Accelerator()", fix)


def _recipe_check(environ: dict) -> Check:
    from ..fixes.start import recipes

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


def _all_gather_check(cfg: dict, environ: dict):
    """``fp8_config.all_gather``: a value it does not accept, or ``fp8`` where prepare would refuse it (no FSDP2,
    CPU offload, a recipe it cannot serve) — the refusal prepare raises, in the same words. None when unset."""
    from .. import settings
    from ..fixes.start import fp8_all_gather_policy as policy
    from ..fixes.start import recipes

    setting = settings.REGISTRY[policy.ENV]
    try:
        value = setting.parse(environ.get(policy.ENV))
    except ValueError as exc:
        return Check("FP8 all-gather", False, str(exc).removeprefix("accel_fp8_fix: "), "all_gather: fp8  (or remove it)")
    if value != "fp8":
        return None if value is None else Check("FP8 all-gather", True, f"{setting.label}: {value}")
    fsdp = cfg.get("fsdp_config") or {}
    is_fsdp2 = str(cfg.get("distributed_type", "NO")).upper() == "FSDP" and _int(fsdp.get("fsdp_version"), 1) == 2
    offload = str(fsdp.get("fsdp_offload_params", False)).lower() in ("true", "1", "yes")
    try:
        choice, source, fields = recipes.settings_from_env(environ)
        mxfp8 = bool(fields.pop("use_mxfp8_block_scaling", False))
        fields.pop("use_autocast_during_eval", None)
        name, _source = recipes.check_settings(choice, source, fields, mxfp8)
        class_name = recipes.RECIPES[name][0] if isinstance(name, str) else type(name).__name__
    except ValueError:
        class_name = None  # reported by the recipe check
    te = _te_version()
    why = policy.refusal(class_name, is_fsdp2=is_fsdp2, cpu_offload=offload,
                         versions={"transformer-engine": te, "torch": _installed("torch")} if te else None)
    if why is not None:
        return Check("FP8 all-gather", False, f"{setting.label}=fp8 cannot run: {why}",
                     "remove `all_gather: fp8` from fp8_config (or all_gather: high_precision)")
    return Check("FP8 all-gather", True, f"{setting.label}: fp8 (weights gathered as FP8 + scale; {class_name})")


def _installed(name: str) -> str | None:
    from ..engine.versions import installed_version

    return installed_version(name)


def _te_version() -> str | None:
    found = _installed("transformer-engine") or _installed("transformer_engine")
    if found is None and importlib.util.find_spec("transformer_engine") is not None:
        return "unknown"
    return found
