"""``accel-fp8-fix doctor``: versions, the chosen patch set and why, what will be patched, activation mode."""

from __future__ import annotations

import argparse
import json
import os
import sys

from . import _api, settings
from .engine import installed_versions
from .engine.declarations import declarations_dir

WATCHED = ("accelerate", "torch", "transformer-engine", "transformers", "wrapt", "packaging")
ENV_VARS = tuple(settings.REGISTRY)  # every setting the package (and its rehearsal) reads: accel_fp8_fix/settings.py


def _pth_installed() -> bool:
    import site

    dirs = list(getattr(site, "getsitepackages", lambda: [])()) + [site.getusersitepackages()]
    return any(os.path.exists(os.path.join(d, "accel_fp8_fix.pth")) for d in dirs)


def _transformers(selection) -> dict:
    """The installed transformers against the set's tested window, and each internals feature's verdict."""
    from .internals import transformers_features

    versions = selection.versions or installed_versions(("transformers",))
    version = versions.get("transformers")
    tested = selection.patch_set.tested.get("transformers") if selection.patch_set else None
    outside = selection.patch_set.outside_tested(versions) if selection.patch_set else []
    return {"version": version, "tested": str(tested) if tested is not None else None,
            "window": "outside: verified by source hash" if outside else "inside",
            "summary": transformers_features.describe(versions),
            "features": {name: {"verified": v.verified, "releases": list(v.releases), "problems": list(v.problems)}
                         for name, v in transformers_features.verdicts(versions).items()}}


def _te_install() -> str | None:
    from .internals.transformer_engine import meta_package_only

    return meta_package_only(installed_versions(("transformer-engine",)))


def doctor(as_json: bool = False) -> int:
    selection = _api.choose_patch_set("fix")
    report = _api.report()
    info = {
        "versions": installed_versions(WATCHED),
        "python": sys.version.split()[0],
        "patch_set": selection.patch_set.name if selection.patch_set else None,
        "why": selection.reason,
        "will_patch": [
            {"target": p.target, "fixes": list(p.fixes), "why": p.why} for p in (selection.patch_set.patches if selection.patch_set else ())
        ],
        "activation": {
            "this process": report.mode,
            "start-up trampoline (.pth) installed": _pth_installed(),
            "environment": {k: os.environ[k] for k in ENV_VARS if k in os.environ},
        },
        "invalid settings": [str(exc) for _setting, exc in settings.check()],
        "transformers": _transformers(selection),
        "transformer-engine": _te_install(),
        "declarations": str(declarations_dir()),
        "status": report.as_dict(),
    }
    ok = selection.supported and not info["invalid settings"]
    if as_json:
        print(json.dumps(info, indent=2, default=str))
        return 0 if ok else 1
    print("accel_fp8_fix doctor")
    print("  installed   : " + ", ".join(f"{k} {v or '-'}" for k, v in info["versions"].items()))
    print(f"  patch set   : {info['patch_set'] or 'none (accelerate stays untouched)'}")
    print(f"  why         : {info['why']}")
    for p in info["will_patch"]:
        print(f"  will patch  : {p['target']}  [{', '.join(p['fixes'])}] {p['why']}")
    print(f"  activation  : {report.mode}")
    print(f"  .pth hook   : {'installed' if info['activation']['start-up trampoline (.pth) installed'] else 'missing'}")
    for key, value in info["activation"]["environment"].items():
        print(f"  env         : {key}={value}")
    for problem in info["invalid settings"]:
        print(f"  INVALID     : {problem}")
    tf = info["transformers"]
    if tf["version"]:
        print(f"  transformers: {tf['version']}, tested window {tf['tested'] or '-'} ({tf['window']}): "
              f"{tf['summary'].partition(': ')[2]}")
        for name, verdict in tf["features"].items():
            state = "verified (" + ", ".join(verdict["releases"]) + ")" if verdict["verified"] else \
                "CHANGED, refused at prepare where a model uses it: " + "; ".join(verdict["problems"])
            print(f"    {name:24}{state}")
    if info["transformer-engine"]:
        print(f"  TE install  : {info['transformer-engine']}")
    print(f"  declarations: {info['declarations']}")
    if report.patches:
        print("  this process:")
        for line in str(report).splitlines():
            print("    " + line)
    return 0 if ok else 1


def doctor_launch(path: str, as_json: bool = False) -> int:
    """``doctor --launch CONFIG.yaml``: the verdict on an accelerate config file (diagnostics/launch_check.py)."""
    from .diagnostics.launch_check import ConfigFileError, check_launch_config

    try:
        verdict = check_launch_config(path)
    except ConfigFileError as exc:  # one line: file:line:column: what the YAML parser found (exit 2: not a verdict)
        print(f"accel_fp8_fix doctor --launch: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        print(f"accel_fp8_fix doctor --launch: cannot read {path}: {exc}", file=sys.stderr)
        return 2
    if as_json:
        from dataclasses import asdict

        print(json.dumps({"path": path, "ok": verdict.ok, "failed": verdict.failed,
                          "checks": [asdict(c) for c in verdict.checks]}, indent=2))
    else:
        print(verdict)
    return 0 if verdict.ok else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="accel-fp8-fix", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    doc = sub.add_parser("doctor", help="print versions, the chosen patch set and why, and the activation mode")
    doc.add_argument("--json", action="store_true", help="machine-readable output")
    doc.add_argument("--launch", metavar="CONFIG.yaml",
                     help="check an accelerate config file: will it run FP8 with the fixes? (exit 1 when not)")
    args = parser.parse_args(argv)
    if args.command == "doctor" and args.launch:
        return doctor_launch(args.launch, as_json=args.json)
    if args.command == "doctor":
        return doctor(as_json=args.json)
    return 2  # pragma: no cover


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
