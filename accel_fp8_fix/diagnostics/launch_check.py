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


def _load(path: str) -> dict:
    import yaml  # accelerate's own dependency (its config files are YAML; JSON is YAML too)

    with open(path) as fh:
        data = yaml.safe_load(fh) or {}
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

    # the flag (or another way in)
    flag = fp8.get("accel_fp8_fix")
    flag_on = flag is True or str(flag).strip().lower() in _api.ON_VALUES
    env_value = environ.get("ACCEL_FP8_FIX", "").strip().lower()
    env_on = bool(env_value) and env_value not in _api.OFF_VALUES
    if env_value and not env_on:
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

    # versions
    selection = _api.choose_patch_set("fix", versions)
    add(Check("versions", selection.supported,
              f"patch set {selection.patch_set.name}: {selection.reason}" if selection.supported else selection.reason,
              "install versions inside a supported window (accel-fp8-fix doctor lists them)"))

    # Transformer Engine installed (not imported: that needs the GPU this check runs before)
    te_version = (versions or {}).get("transformer-engine") if versions is not None else _te_version()
    rehearsal = environ.get("ACCEL_FP8_FIX_EMULATE_TE", "").strip().lower() in _api.ON_VALUES
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


def _te_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("transformer-engine", "transformer_engine"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None if importlib.util.find_spec("transformer_engine") is None else "unknown"
