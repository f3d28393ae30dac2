#!/usr/bin/env python3
"""Version matrix: one virtual environment per torch release, the distributed suite in each, a results table.

    python scripts/version_matrix.py 2.7 2.9 2.14            # minors: the newest patch pip finds
    python scripts/version_matrix.py 2.9.1 --tests tests/distributed/test_fsdp2_fp8.py
    python scripts/version_matrix.py --table-only            # rewrite the docs table from stored results
    python scripts/version_matrix.py --newest --tests tests/distributed/test_tp_fp8.py   # CI's canary

``--newest`` (CI's canary): the registry's newest torch, accelerate, transformers and Transformer Engine, resolved
when it runs, in one venv. ``tests/network/test_canary.py`` runs first (the news, and the package's verified
behaviour on those releases); the ``--tests`` run only when every one of them is inside its declared window (a
release inside a window that fails them is a broken promise: a red CI); outside, the canary's checks are the run.

For each torch version: a venv under ``--root`` (default ``.matrix/``, ignored by git) with that torch
(the registry's builds — CUDA ones run on CPU), then this checkout (editable) with its ``test`` and
``rehearsal-dev`` extras and the suite's pins (accelerate, transformers, Transformer Engine; torch held by a
constraint so no later install moves it). The suite (``tests/distributed`` by default) runs under the
shared test lock (``$ACCEL_FP8_FIX_TEST_LOCK``, default ``/tmp/accel_fp8_fix.mp.lock``, the one every runner takes) so gloo ranks
of other jobs never oversubscribe the cores. Each run leaves ``<root>/results/torch-<version>.json`` (and the
junit XML); the table between the markers of ``docs/compatibility.md`` is rebuilt from every stored result.
An existing venv whose torch matches is reused. Exit status: non-zero when a suite failed or a build failed.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import fcntl
import json
import os
import platform
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "compatibility.md"
START, END = "<!-- version-matrix:start -->", "<!-- version-matrix:end -->"
# The pins the suite is written against (scripts/setup.sh); torch is the only variable here.
PINS = {"accelerate": "1.16.0", "transformers": "5.25.0", "transformer-engine": "2.20.2"}
LOCK = os.environ.get("ACCEL_FP8_FIX_TEST_LOCK", "/tmp/accel_fp8_fix.mp.lock")  # "0": none, as in scripts/test.sh


def log(msg: str) -> None:
    print(f"[version-matrix {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def torch_requirement(spec: str) -> str:
    """``2.9`` -> ``torch==2.9.*`` (newest patch); ``2.9.1`` -> ``torch==2.9.1``."""
    if not re.fullmatch(r"\d+\.\d+(\.\d+)?", spec):
        raise SystemExit(f"version-matrix: torch version {spec!r} must look like 2.9 or 2.9.1")
    return f"torch=={spec}.*" if spec.count(".") == 1 else f"torch=={spec}"


def installed(python: Path, dist: str) -> str | None:
    out = subprocess.run([str(python), "-c", f"from importlib.metadata import version; print(version({dist!r}))"],
                         capture_output=True, text=True)
    return out.stdout.strip() or None if out.returncode == 0 else None


def matches(found: str | None, spec: str) -> bool:
    return found is not None and (found.split("+")[0] + ".").startswith(spec + ".")


# A machine's pip configuration may cap releases (this image's global constraint file keeps torch <= 2.14.1, the
# builds on its disk); a release past the cap is installed from the registry with that configuration left out.
PAST_CAP = {"PIP_CONFIG_FILE": os.devnull}


def pip(python: Path, *args: str, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [str(python), "-m", "pip", "install", "--quiet", *args]
    log(" ".join(cmd[3:]) + (" (past the local pip cap)" if env else ""))
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})
    if out.returncode != 0:
        tail = "\n".join(line for line in out.stderr.splitlines() if not line.startswith("WARNING: Location"))[-3000:]
        raise RuntimeError(f"pip install {' '.join(args)} failed:\n{tail}")
    return out


def capped(error: RuntimeError) -> bool:
    """pip refused a release the local configuration hides (not one the registry lacks)."""
    return "No matching distribution" in str(error) or "ResolutionImpossible" in str(error) \
        or "conflicting dependencies" in str(error)


def build(root: Path, spec: str, pins: dict, timeout: float) -> Path:
    """The venv of torch ``spec`` (created, or reused if its torch matches); its python."""
    venv = root / f"torch-{spec}"
    python = venv / "bin" / "python"
    if python.exists() and matches(installed(python, "torch"), spec) and installed(python, "accel_fp8_fix"):
        log(f"reusing {venv} (torch {installed(python, 'torch')})")
        return python
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = None
    try:
        pip(python, torch_requirement(spec), timeout=timeout)
    except RuntimeError as error:
        if not capped(error):
            raise
        env = PAST_CAP
        pip(python, torch_requirement(spec), timeout=timeout, env=env)
    torch_version = installed(python, "torch")
    constraints = venv / "constraints.txt"
    constraints.write_text(f"torch=={torch_version}\n")  # later installs must not move torch (triton pins do)
    pip(python, "-c", str(constraints), "-e", f"{REPO}[test,rehearsal-dev]",
        *(f"{name}=={version}" for name, version in pins.items()), timeout=timeout, env=env)
    log(f"built {venv}: torch {torch_version}" + (" (past the local pip cap)" if env else ""))
    return python


class _Lock:
    def __init__(self, path: str | None):
        self.path, self.fh = path, None

    def __enter__(self):
        if self.path:
            self.fh = open(self.path, "a")
            log(f"waiting for the test lock {self.path}")
            fcntl.flock(self.fh, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        if self.fh:
            fcntl.flock(self.fh, fcntl.LOCK_UN)
            self.fh.close()


def run_suite(python: Path, spec: str, root: Path, tests: list[str], lock: str | None, timeout: float,
              pytest_args: list[str], extra_env: dict | None = None) -> dict:
    results = root / "results"
    results.mkdir(parents=True, exist_ok=True)
    junit = results / f"torch-{spec}.xml"
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(extra_env or {})}  # (bytecode caches: tests/conftest.py keeps them)
    env.pop("VIRTUAL_ENV", None)
    env["PATH"] = f"{python.parent}{os.pathsep}{env.get('PATH', '')}"  # accelerate launch etc. of this venv
    cmd = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *pytest_args, *tests]
    with _Lock(lock):
        log(f"torch {spec}: {' '.join(cmd[1:])}")
        started = time.monotonic()
        try:
            out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
            code, tail = out.returncode, (out.stdout + out.stderr)[-4000:]
        except subprocess.TimeoutExpired as exc:
            code, tail = "timeout", f"suite ran past {timeout:.0f} s\n{(exc.stdout or b'')[-2000:]!r}"
        seconds = time.monotonic() - started
    (results / f"torch-{spec}.log").write_text(tail)
    record = {
        "torch_spec": spec,
        "versions": {name: installed(python, name) for name in ("torch", "accelerate", "transformers",
                                                                 "transformer-engine", "triton")},
        "python": platform.python_version(),
        "tests": tests,
        "exit": code,
        "seconds": round(seconds),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d"),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                 text=True).stdout.strip(),
        **junit_counts(junit),
    }
    (results / f"torch-{spec}.json").write_text(json.dumps(record, indent=1))
    return record


def junit_counts(path: Path) -> dict:
    counts = {"passed": 0, "failed": 0, "skipped": 0, "failures": []}
    if not path.exists():
        return counts
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            counts["failed"] += 1
            message = (bad.get("message") or "").strip().splitlines()
            counts["failures"].append({"test": name, "message": message[0][:200] if message else ""})
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts


def _key(record: dict):
    version = (record["versions"].get("torch") or record["torch_spec"]).split("+")[0]
    return tuple(int(p) for p in re.findall(r"\d+", version)[:3])


def _cause(message: str) -> str:
    """A failure message without the scenario / setup wrapping, so that one cause groups its tests."""
    message = re.sub(r'^failed on setup with "', "", message)
    message = re.sub(r"^AssertionError: scenario \S+ raised on rank \d+: ", "", message)
    return message[:160]


def table(root: Path) -> str:
    records = sorted((json.loads(p.read_text()) for p in (root / "results").glob("torch-*.json")), key=_key)
    if not records:
        return "(no results yet: run `python scripts/version_matrix.py <torch versions>`)"
    lines = ["| torch | triton | accelerate | transformers | TE (Python) | suite | passed | failed | skipped | time | commit |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        v = r["versions"]
        suite = " ".join(t.replace("tests/", "") for t in r["tests"])
        lines.append(f"| {v.get('torch')} | {v.get('triton')} | {v.get('accelerate')} | {v.get('transformers')} | "
                     f"{v.get('transformer-engine')} | `{suite}` | {r['passed']} | {r['failed']} | {r['skipped']} | "
                     f"{r['seconds'] // 60} min {r['seconds'] % 60:02d} s | {r['date']} {r['commit']} |")
    for r in records:
        if not r["failures"]:
            continue
        causes: dict[str, list[str]] = {}
        for f in r["failures"]:
            causes.setdefault(_cause(f["message"]), []).append(f["test"])
        lines += ["", f"Failures on torch {r['versions'].get('torch')} ({r['failed']}), by cause:", ""]
        for cause, tests in sorted(causes.items(), key=lambda kv: -len(kv[1])):
            more = f" and {len(tests) - 1} more" if len(tests) > 1 else ""
            lines.append(f"- {len(tests)} × `{cause}` — e.g. `{tests[0]}`{more}")
    return "\n".join(lines)


def write_table(root: Path, doc: Path) -> None:
    text = doc.read_text() if doc.exists() else f"# Compatibility\n\n{START}\n{END}\n"
    if START not in text or END not in text:
        raise SystemExit(f"version-matrix: {doc} lacks the markers {START} / {END}")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(f"{head}{START}\n{table(root)}\n{END}{tail}")
    log(f"table written to {doc}")


CANARY = "tests/network/test_canary.py"
WINDOWS = """
import json
from accel_fp8_fix import _api
s = _api.choose_patch_set("fix")
print(json.dumps({"supported": s.supported, "reason": s.reason,
                  "outside_tested": s.patch_set.outside_tested(s.versions) if s.patch_set else []}))
"""


def newest() -> tuple[str, dict]:
    """(the registry's newest torch, {accelerate, transformers, transformer-engine: the registry's newest})."""
    sys.path.insert(0, str(REPO / "scripts"))
    from newest_releases import registry_versions

    found = {}
    for name in ("torch", *PINS):
        released = registry_versions(name)
        if isinstance(released, str) or not released:
            raise SystemExit(f"version-matrix: --newest: {name}: {released or 'no release'}")
        found[name] = str(released[0])
    log("the registry's newest: " + ", ".join(f"{k} {v}" for k, v in found.items()))
    return found.pop("torch"), found


def canary_tests(python: Path, tests: list[str]) -> list[str]:
    """The canary's tests for the venv of ``python``: its own file, then ``tests`` when every release is inside."""
    out = subprocess.run([str(python), "-c", WINDOWS], capture_output=True, text=True, cwd=REPO)
    verdict = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else None
    if verdict is None:
        log(f"canary: could not read the windows: {out.stderr[-1000:]}")
        return [CANARY]
    news = verdict["outside_tested"] + ([] if verdict["supported"] else [verdict["reason"]])
    if news:
        log("canary: NEWS (outside a declared window): " + "; ".join(news) + f" — running {CANARY} only")
        return [CANARY]
    log("canary: every newest release is inside its declared window: the files must pass")
    return [CANARY, *tests]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("torch", nargs="*", help="torch versions: a minor (2.9: newest patch) or exact (2.9.1)")
    parser.add_argument("--root", type=Path, default=REPO / ".matrix", help="venvs and results (default .matrix/)")
    parser.add_argument("--tests", nargs="+", default=["tests/distributed"], help="test paths (default tests/distributed)")
    parser.add_argument("--pytest-args", default="", help="extra pytest arguments, one string")
    parser.add_argument("--build-only", action="store_true", help="build the venvs, run nothing")
    parser.add_argument("--table-only", action="store_true", help="only rewrite the docs table from stored results")
    parser.add_argument("--no-docs", action="store_true", help="do not touch docs/compatibility.md")
    parser.add_argument("--no-lock", action="store_true", help="run without the shared test lock")
    parser.add_argument("--remove-venv", action="store_true", help="delete each venv after its run (disk: ~7 GB each)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per pip install and per suite run")
    parser.add_argument("--newest", action="store_true",
                        help="CI's canary: the registry's newest torch and pins, resolved now (no torch argument)")
    for name, version in PINS.items():
        parser.add_argument(f"--{name}", default=version, help=f"pinned {name} (default {version})")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    if args.table_only:
        write_table(root, DOC)
        return 0
    pins = {name: getattr(args, name.replace("-", "_")) for name in PINS}
    if args.newest:
        if args.torch:
            parser.error("--newest resolves torch itself: name no torch version")
        torch_version, pins = newest()
        args.torch = [torch_version]
    if not args.torch:
        parser.error("name at least one torch version")
    status = 0
    for spec in args.torch:
        torch_requirement(spec)
        try:
            python = build(root, spec, pins, args.timeout)
        except (RuntimeError, subprocess.SubprocessError) as exc:
            log(f"torch {spec}: build failed: {exc}")
            status = 1
            continue
        if args.build_only:
            continue
        tests = canary_tests(python, args.tests) if args.newest else args.tests
        record = run_suite(python, spec, root, tests, None if args.no_lock or LOCK == "0" else LOCK, args.timeout,
                           args.pytest_args.split(), {"ACCEL_FP8_FIX_CANARY": "1"} if args.newest else None)
        log(f"torch {record['versions']['torch']}: {record['passed']} passed, {record['failed']} failed, "
            f"{record['skipped']} skipped in {record['seconds']} s (exit {record['exit']})")
        status |= record["exit"] != 0
        if not args.no_docs:
            write_table(root, DOC)
        if args.remove_venv:
            subprocess.run(["rm", "-rf", str(python.parent.parent)], check=False)
    return int(bool(status))


if __name__ == "__main__":
    sys.exit(main())
