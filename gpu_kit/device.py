"""The device the kit runs on, read and compared with the profile the CPU rehearsal answers as
(``accel_fp8_fix/rehearsal/te_on_cpu/target.py``). Standard library at import: ``read_facts`` imports torch
inside, and runs in a child process (``read``) so that nothing it does can stop the stage.

The rule (``compare``): a field Transformer Engine decides from — the compute capability, the CUDA version
(``torch.version.cuda``, major.minor) and the cuBLASLt version (major.minor) — that disagrees with the
profile **fails**: the rehearsal then answers TE as another machine would. Every other difference (GPU name,
SM count, L2, memory beyond 2 %, cuDNN, a cuBLASLt patch level) and every field that could not be read
**warns**. A field that cannot be read is recorded as ``{"unknown": reason}``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET_FILE = ROOT / "accel_fp8_fix" / "rehearsal" / "te_on_cpu" / "target.py"
DECIDING = ("capability", "cuda", "cublaslt")  # what TE's support checks read: a difference fails
WARNING = ("gpu", "sm_count", "l2_cache", "total_memory", "cudnn")  # a difference warns
MEMORY_TOLERANCE = 0.02  # ECC and firmware reservations move total_memory by a little
MARK = "GPU_KIT_DEVICE "


def unknown(reason: str) -> dict:
    return {"unknown": reason}


def is_unknown(value) -> bool:
    return isinstance(value, dict) and "unknown" in value


def distribution_versions(names: list[str]) -> dict:
    """{name: version, or None where it is not installed} as this interpreter's ``importlib.metadata`` finds them."""
    from importlib import metadata

    found = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
        except Exception as exc:  # a broken dist-info
            found[name] = unknown(f"{type(exc).__name__}: {exc}")
    return found


def _encode_version(text: str) -> int:
    """"13.1.0.3" -> 130100: ``cublasLtGetVersion``'s major*10000 + minor*100 + patch."""
    major, minor, patch = (int(p) for p in (text.split(".") + ["0", "0"])[:3])
    return major * 10000 + minor * 100 + patch


def _loaded_cublaslt() -> list[str]:
    with open("/proc/self/maps") as maps:
        return sorted({line.split()[-1] for line in maps if "libcublasLt" in line and "/" in line})


def read_cublaslt(torch) -> tuple[int | dict, str]:
    """(version, how it was read): ``cublasLtGetVersion()`` of the libcublasLt this torch loaded, else the
    version of the nvidia-cublas distribution torch depends on."""
    import ctypes

    why = []
    try:
        paths = _loaded_cublaslt()
        if not paths and torch.cuda.is_available():  # loaded lazily: a GEMM creates the handle
            torch.ones(8, 8, device="cuda") @ torch.ones(8, 8, device="cuda")
            paths = _loaded_cublaslt()
        if paths:
            get_version = ctypes.CDLL(paths[0]).cublasLtGetVersion
            get_version.restype = ctypes.c_size_t
            also = f" (also loaded: {', '.join(paths[1:])})" if paths[1:] else ""
            return int(get_version()), f"cublasLtGetVersion() of {paths[0]}{also}"
        why.append("no libcublasLt loaded in this process")
    except Exception as exc:
        why.append(f"cublasLtGetVersion: {type(exc).__name__}: {exc}")
    for name, version in distribution_versions(["nvidia-cublas", "nvidia-cublas-cu13", "nvidia-cublas-cu12"]).items():
        if isinstance(version, str):
            return _encode_version(version), f"distribution {name} {version}"
    why.append("no nvidia-cublas distribution installed")
    return unknown("; ".join(why)), "unread"


def read_facts(distributions: list[str]) -> dict:
    """What TE decides from and the rest of the profile's fields, read here; each field that cannot be read
    is ``{"unknown": reason}``, never an exception."""
    facts: dict = {"te_distributions": distribution_versions(distributions)}
    try:
        import torch
    except Exception as exc:
        reason = f"import torch: {type(exc).__name__}: {exc}"
        return dict(facts, **{field: unknown(reason) for field in DECIDING + WARNING})
    facts["cuda"] = torch.version.cuda  # None: a torch built without CUDA, itself a disagreement
    try:
        facts["cudnn"] = torch.backends.cudnn.version() or unknown("torch.backends.cudnn.version() is None")
    except Exception as exc:
        facts["cudnn"] = unknown(f"{type(exc).__name__}: {exc}")
    facts["cublaslt"], facts["cublaslt_read"] = read_cublaslt(torch)
    try:
        if not torch.cuda.is_available():
            raise RuntimeError("torch.cuda.is_available() is False")
        props = torch.cuda.get_device_properties(0)
    except Exception as exc:
        reason = f"torch.cuda.get_device_properties(0): {type(exc).__name__}: {exc}"
        return dict(facts, **{field: unknown(reason) for field in ("gpu", "capability", "sm_count", "l2_cache",
                                                                  "total_memory")})
    for field, attribute in (("gpu", "name"), ("sm_count", "multi_processor_count"), ("l2_cache", "L2_cache_size"),
                             ("total_memory", "total_memory")):
        value = getattr(props, attribute, None)
        facts[field] = value if value is not None else unknown(f"get_device_properties has no {attribute}")
    facts["capability"] = [props.major, props.minor]
    return facts


def read(distributions: list[str], timeout: float = 180) -> dict:
    """``read_facts`` in a fresh process of this interpreter (torch's CUDA state stays out of the caller)."""
    code = (f"import json; from gpu_kit import device; "
            f"print(device.MARK + json.dumps(device.read_facts({distributions!r}), default=str))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                              timeout=timeout)
        for line in done.stdout.splitlines():
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
        reason = f"device reader exited {done.returncode}: {(done.stderr or done.stdout)[-800:]}"
    except Exception as exc:  # a hang (timeout), an interpreter that does not start
        reason = f"device reader: {type(exc).__name__}: {exc}"
    return {field: unknown(reason) for field in ("te_distributions", *DECIDING, *WARNING)}


def rehearsed_profile() -> dict:
    """The profile the rehearsal answers as (``target.profile()``: its settings, default ``h200-cu130``), as a
    dict; target.py is loaded by path, so the package (and torch) is not imported."""
    spec = importlib.util.spec_from_file_location("gpu_kit_rehearsal_target", TARGET_FILE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    chosen = module.profile()
    return {field: getattr(chosen, field) for field in chosen.__dataclass_fields__}


def _major_minor(version) -> tuple[int, int] | None:
    """(13, 0) of "13.0" or "13.0.2", (13, 1) of a cuBLASLt 130100; None if neither."""
    if isinstance(version, int):
        return version // 10000, version // 100 % 100
    try:
        major, minor = str(version).split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None


def _disagreement(field: str, device, expected) -> str | None:
    """Why ``device`` differs from the profile's ``expected`` for ``field``; None when they agree."""
    if field == "capability":
        same = tuple(device) == tuple(expected)
    elif field in ("cuda", "cublaslt"):
        same = device is not None and _major_minor(device) == _major_minor(expected)
    elif field == "total_memory":
        same = abs(device - expected) <= MEMORY_TOLERANCE * expected
    else:
        same = device == expected
    return None if same else f"device {_shown(field, device)}, profile {_shown(field, expected)}"


def _shown(field: str, value) -> str:
    if field in ("l2_cache", "total_memory") and isinstance(value, int):
        unit, size = ("MiB", 2**20) if field == "l2_cache" else ("GiB", 2**30)
        return f"{value / size:.1f} {unit} ({value} bytes)"
    return ".".join(map(str, value)) if field == "capability" else repr(value)


def compare(facts: dict, profile: dict) -> dict:
    """The device ``facts`` (``read_facts``) against a profile (``rehearsed_profile``): verdict "fail" when a field
    TE decides from disagrees, else "warn" when any other field disagrees or a field is unknown, else "pass"."""
    failed, warnings, agreed = {}, {}, []
    for field in DECIDING + WARNING:
        device, expected = facts.get(field, unknown("not recorded")), profile[field]
        if is_unknown(device):
            warnings[field] = f"unknown ({device['unknown']}); profile {_shown(field, expected)}"
            continue
        why = _disagreement(field, device, expected)
        if why is None and field == "cublaslt" and device != expected:
            warnings[field] = f"device {device}, profile {expected} (the patch level only: TE reads major.minor)"
        elif why is None:
            agreed.append(field)
        elif field in DECIDING:
            failed[field] = why
        else:
            warnings[field] = why
    verdict = "fail" if failed else "warn" if warnings else "pass"
    return {"profile": profile["name"], "verdict": verdict, "failed": failed, "warnings": warnings, "agreed": agreed}


def check(facts: dict) -> dict:
    """``compare`` against the rehearsed profile; a profile that cannot be chosen (a wrong setting) warns."""
    try:
        profile = rehearsed_profile()
    except Exception as exc:
        return {"profile": None, "verdict": "warn", "failed": {}, "agreed": [],
                "warnings": {"profile": f"the rehearsed profile: {type(exc).__name__}: {exc}"}}
    return compare(facts, profile)


def with_te_answers(facts: dict, imported: dict) -> dict:
    """``facts`` with TE's own cuBLASLt reading (``tex.get_cublasLt_version()``, the kit's import probe) in
    place of the probe's: the value TE decides from."""
    answer = imported.get("te_cublaslt")
    if not isinstance(answer, int):
        return facts
    return dict(facts, cublaslt=answer, cublaslt_read="transformer_engine_torch.get_cublasLt_version()",
                cublaslt_probe=facts.get("cublaslt"))


def describe(check: dict) -> str:
    """One line for a log or summary.md."""
    parts = [f"device against the rehearsal's profile {check['profile']}: {check['verdict'].upper()}"]
    parts += [f"{field} FAILS ({why})" for field, why in check["failed"].items()]
    parts += [f"{field} warns ({why})" for field, why in check["warnings"].items()]
    return "; ".join(parts)
