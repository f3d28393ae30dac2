#!/usr/bin/env python3
"""Where the suite's time goes: per test file, its launches and the rank-seconds they spend starting (interpreter
and imports), running scenarios and waiting; then the slowest tests.

    python scripts/suite_profile.py                       # runs the whole suite (under the test lock), then the tables
    python scripts/suite_profile.py tests/distributed     # any pytest arguments
    python scripts/suite_profile.py --from DIR            # the tables again from a run's files (DIR/profile.jsonl,
                                                          # DIR/junit.xml), nothing run
    python scripts/suite_profile.py --write-docs ...      # also rewrite the table in docs/testing.md

Every launch (``run_distributed`` or a pooled run, ``accel_fp8_fix.testing``) appends a line to
``$ACCEL_FP8_FIX_TEST_PROFILE``: the test that started it, its ranks' start / scenario / exit times and CPU
seconds. Per rank: *start-up* is spawn to the scenario's first line (a fresh interpreter: Python, the ``.pth``,
torch, accelerate, the test module; a pool: its start, paid by the launch that triggered it), *running* is the
scenario function (including the imports it does itself), *waiting* is wall minus CPU (blocked in a collective or
waiting for a core). Run it on the 2-core machine, nothing else running, for figures worth writing down.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "testing.md"
START, END = "<!-- suite-profile:start -->", "<!-- suite-profile:end -->"


def run_suite(out: Path, pytest_args: list[str]) -> float:
    env = {**os.environ, "ACCEL_FP8_FIX_TEST_PROFILE": str(out / "profile.jsonl"), "OMP_NUM_THREADS": "1"}
    cmd = ["bash", str(REPO / "scripts" / "test.sh"), "-p", "no:cacheprovider", f"--junitxml={out / 'junit.xml'}",
           *pytest_args]
    started = time.monotonic()
    subprocess.run(cmd, cwd=REPO, env=env)
    return time.monotonic() - started


def read_junit(path: Path) -> list[dict]:
    tests = []
    for case in ET.parse(path).getroot().iter("testcase"):
        file = case.get("classname", "").replace(".", "/") + ".py"
        outcome = "failed" if case.find("failure") is not None or case.find("error") is not None else (
            "skipped" if case.find("skipped") is not None else "passed")
        tests.append({"file": file, "name": case.get("name"), "seconds": float(case.get("time") or 0),
                      "outcome": outcome})
    return tests


def _rank_figures(line: dict) -> tuple[float, float, float, float]:
    """(start-up, running, waiting, cpu) rank-seconds of one launch."""
    wall = line["ended"] - line["started"]
    start = run = wait = cpu = 0.0
    if line.get("pooled"):
        start = sum(line.get("pool_import_s") or []) if line.get("pool_start_s") else 0.0
        for rank in filter(None, line["ranks"]):
            run += rank["run_s"] + rank["reset_s"]
            cpu += rank["cpu_s"]
            wait += max(rank["run_s"] + rank["reset_s"] - rank["cpu_s"], 0.0)
        return start, run, wait, cpu
    for rank in filter(None, line["ranks"]):
        start += rank["fn"] - line["started"]
        run += rank["done"] - rank["fn"]
        cpu += rank["cpu_s"]
        wait += max(wall - rank["cpu_s"], 0.0)
    return start, run, wait, cpu


def file_table(tests: list[dict], launches: list[dict]) -> list[str]:
    per_file: dict[str, dict] = defaultdict(lambda: defaultdict(float))
    for t in tests:
        f = per_file[t["file"]]
        f["tests"] += 1
        f["seconds"] += t["seconds"]
    for line in launches:
        file = line["test"].split("::", 1)[0] or "(outside a test)"
        start, run, wait, _ = _rank_figures(line)
        f = per_file[file]
        f["pooled" if line.get("pooled") else "fresh"] += 1
        f["start"] += start
        f["run"] += run
        f["wait"] += wait
        f["launch_wall"] += (line["ended"] - line["started"]) + (line.get("pool_start_s") or 0.0)
    rows = ["| file | tests | seconds | launches (pooled + fresh) | launch wall s | rank-s start-up | rank-s running "
            "| rank-s waiting |", "|---|---|---|---|---|---|---|---|"]
    for file, f in sorted(per_file.items(), key=lambda kv: -kv[1]["seconds"]):
        if f["seconds"] < 1 and not (f["pooled"] or f["fresh"]):
            continue
        rows.append(f"| {file} | {int(f['tests'])} | {f['seconds']:.0f} | {int(f['pooled'])} + {int(f['fresh'])} | "
                    f"{f['launch_wall']:.0f} | {f['start']:.0f} | {f['run']:.0f} | {f['wait']:.0f} |")
    return rows


def totals(tests: list[dict], launches: list[dict], wall: float | None) -> list[str]:
    figures = [_rank_figures(line) for line in launches]
    start, run, wait = (sum(f[i] for f in figures) for i in range(3))
    outcomes = defaultdict(int)
    for t in tests:
        outcomes[t["outcome"]] += 1
    pooled = sum(1 for line in launches if line.get("pooled"))
    starts = sum(1 for line in launches if line.get("pool_start_s"))
    head = f"{wall / 60:.1f} min wall; " if wall else ""
    return [f"{head}{len(tests)} tests ({', '.join(f'{n} {k}' for k, n in sorted(outcomes.items()))}); "
            f"{len(launches)} launches: {pooled} pooled ({starts} pool starts), {len(launches) - pooled} fresh; "
            f"rank-seconds: start-up {start:.0f}, running {run:.0f}, waiting {wait:.0f}; "
            f"test time {sum(t['seconds'] for t in tests):.0f} s"]


def slowest(tests: list[dict], n: int = 15) -> list[str]:
    rows = ["| slowest tests | seconds |", "|---|---|"]
    for t in sorted(tests, key=lambda t: -t["seconds"])[:n]:
        rows.append(f"| {t['file']}::{t['name']} | {t['seconds']:.1f} |")
    return rows


def render(out: Path, wall: float | None) -> str:
    tests = read_junit(out / "junit.xml")
    profile = out / "profile.jsonl"
    lines = [json.loads(line) for line in profile.read_text().splitlines()] if profile.exists() else []
    launches = [line for line in lines if "retire" not in line]
    stamp = time.strftime("%Y-%m-%d")
    return "\n".join([f"Measured {stamp} (`python scripts/suite_profile.py`): " + totals(tests, launches, wall)[0],
                      "", *file_table(tests, launches), "", *pool_table(lines), "", *slowest(tests)])


def pool_table(lines: list[dict]) -> list[str]:
    """Per pool (world size, environment): its starts, the seconds they took, and why it closed each time."""
    pools: dict[tuple, dict] = defaultdict(lambda: {"starts": 0, "start_s": 0.0, "closed": defaultdict(int)})
    for line in lines:
        if "pool_env" not in line:
            continue
        key = (line["world_size"], json.dumps(line["pool_env"], sort_keys=True))
        if "retire" in line:
            pools[key]["closed"][line["retire"]] += 1
        elif line.get("pool_start_s"):
            pools[key]["starts"] += 1
            pools[key]["start_s"] += line["pool_start_s"]
    rows = ["| pool (ranks, environment) | starts | start s | closed because |", "|---|---|---|---|"]
    for (ranks, env), p in sorted(pools.items(), key=lambda kv: -kv[1]["start_s"]):
        closed = ", ".join(f"{why} x{n}" for why, n in sorted(p["closed"].items()))
        rows.append(f"| {ranks}, `{env}` | {p['starts']} | {p['start_s']:.0f} | {closed} |")
    return rows


def write_docs(text: str) -> None:
    doc = DOC.read_text()
    if START not in doc:
        raise SystemExit(f"suite-profile: no {START} marker in {DOC}")
    head, rest = doc.split(START, 1)
    tail = rest.split(END, 1)[1]
    DOC.write_text(f"{head}{START}\n{text}\n{END}{tail}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="source", help="a folder with profile.jsonl and junit.xml: nothing is run")
    parser.add_argument("--write-docs", action="store_true", help="rewrite the table in docs/testing.md")
    args, pytest_args = parser.parse_known_args(argv)
    if args.source:
        out, wall = Path(args.source), None
    else:
        out = Path(tempfile.mkdtemp(prefix="suite_profile_"))
        wall = run_suite(out, pytest_args)
        print(f"suite-profile: files in {out}", file=sys.stderr)
    text = render(out, wall)
    print(text)
    if args.write_docs:
        write_docs(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
