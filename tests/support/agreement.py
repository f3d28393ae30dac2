"""Pooled runs must agree with fresh interpreters: one scenario per test file, rotating, runs again in fresh ranks.

Every pooled launch through ``scenarios.launch`` is recorded here with its results. At the end of the session
(``tests/distributed/test_pool_agreement.py``, moved last by ``tests/conftest.py``) one launch per test file and one
scenario of its plan are chosen by the rotation number (``ACCEL_FP8_FIX_TEST_ROTATION``, default: today's date, so
CI rotates through the plans day by day), and the chosen scenarios run again in fresh interpreters
(``run_distributed``) — one fresh launch per world size and environment, each chosen scenario first in a fresh
launch on some day: the rotation also turns the order. Their facts must equal the pooled ones exactly: a scenario
that depends on what ran before it in the same ranks (state the pool failed to put back) shows here.

Scenarios that read or write a folder (a keyword argument ending in ``dir`` or ``path``: checkpoints written by
one scenario and read by the next) only mean something in their plan's order and are not chosen.
"""

from __future__ import annotations

import datetime
import json
import os
import re

RECORDS: dict[str, list[dict]] = {}  # test file -> the pooled launches its tests started, in order


def current_test_file() -> str:
    return os.environ.get("PYTEST_CURRENT_TEST", "").split("::", 1)[0] or "(outside a test)"


def record(module: str, plan: list, world_size: int, env: dict | None, audit_collectives: bool, timeout: float,
           collective_timeout: float, results: list) -> None:
    RECORDS.setdefault(current_test_file(), []).append(
        {"module": module, "plan": plan, "world_size": world_size, "env": dict(env or {}),
         "audit": audit_collectives, "timeout": timeout, "collective_timeout": collective_timeout,
         "results": results})


def rotation() -> int:
    value = os.environ.get("ACCEL_FP8_FIX_TEST_ROTATION", "").strip()
    return int(value) if value else datetime.date.today().toordinal()


def _names_a_folder(kwargs) -> bool:
    """A keyword argument (at any depth: plans that wrap other modules' scenarios nest theirs) names a folder."""
    if isinstance(kwargs, dict):
        return any(str(k).endswith(("dir", "path")) or _names_a_folder(v) for k, v in kwargs.items())
    return False


def _eligible(plan: list) -> list[int]:
    return [i for i, (_, kwargs) in enumerate(plan) if not _names_a_folder(kwargs or {})]


def launch_cap() -> int:
    """At most this many fresh launches (``ACCEL_FP8_FIX_TEST_AGREEMENT_LAUNCHES``; 0 or unset: as many as the files
    need). The README's command (scripts/test.sh) sets 1: the lead's environment only."""
    value = os.environ.get("ACCEL_FP8_FIX_TEST_AGREEMENT_LAUNCHES", "").strip()
    return int(value) if value else 0


def choices(turn: int | None = None, cap: int | None = None) -> list[dict]:
    """Per test file: the launch and the scenario of its plan this rotation checks.

    Each chosen (world size, environment, audit) costs a fresh launch of its own, so the files share as few of them
    as the rotation allows: one file leads (``turn % files``) and its pick (``turn // files``-th of its eligible
    scenarios: every scenario of every file leads on some day) stands whatever its launch's environment; the
    others pick, by the rotation, among their scenarios in the environments already chosen, and a file with none
    there adds the environment most of the still uncovered files can use. With a ``cap`` (default
    :func:`launch_cap`) of fresh launches, the environments past it are not added and the files left with none are
    not checked this turn (each still leads on its days: every scenario is chosen on some day)."""
    turn = rotation() if turn is None else turn
    cap = launch_cap() if cap is None else cap
    files = []
    for file, launches in sorted(RECORDS.items()):
        candidates = [(launch, i) for launch in launches for i in _eligible(launch["plan"])]
        if candidates:
            files.append((file, candidates))
    if not files:
        return []
    lead = turn % len(files)
    lead_candidates = files[lead][1]
    lead_pick = lead_candidates[(turn // len(files)) % len(lead_candidates)]
    used = {_group_key(lead_pick[0])}
    while not cap or len(used) < cap:
        uncovered = [c for f, (_, c) in enumerate(files)
                     if f != lead and not any(_group_key(launch) in used for launch, _ in c)]
        if not uncovered:
            break
        usable = sorted({key for c in uncovered for key in {_group_key(launch) for launch, _ in c}})
        shift = turn % len(usable)
        usable = usable[shift:] + usable[:shift]  # ties go round with the rotation
        used.add(max(usable, key=lambda key: sum(any(_group_key(launch) == key for launch, _ in c)
                                                  for c in uncovered)))
    chosen = []
    for f, (file, candidates) in enumerate(files):
        if f == lead:
            launch, i = lead_pick
        else:
            mine = [(launch, i) for launch, i in candidates if _group_key(launch) in used]
            if not mine:  # its environments are past the cap: not this turn
                continue
            launch, i = mine[turn % len(mine)]
        name, kwargs = launch["plan"][i]
        chosen.append({"file": file, "launch": launch, "index": i, "name": name, "kwargs": kwargs or {}})
    return chosen


def _group_key(launch: dict) -> tuple:
    return (launch["world_size"], json.dumps(launch["env"], sort_keys=True), launch["audit"])


def groups(chosen: list[dict], turn: int | None = None) -> dict[tuple, list[dict]]:
    """The chosen scenarios by (world size, environment, audit): one fresh launch each, order rotated."""
    turn = rotation() if turn is None else turn
    out: dict[tuple, list[dict]] = {}
    for c in chosen:
        out.setdefault(_group_key(c["launch"]), []).append(c)
    for key, members in out.items():
        shift = turn % len(members)
        out[key] = members[shift:] + members[:shift]
    return out


_VOLATILE = re.compile(r"0x[0-9a-f]{6,}|/tmp/[\w./-]+|port \d+|:\d{4,5}\b")


# Facts no two processes share by nature: wall times (``step_s``, ``*_seconds``), and dynamo's frame counts, which
# depend on what the process compiled before (a pooled rank that compiled in an earlier run sees 3 more frames of
# torch's own code than a fresh one: 116 against 113) — the tests assert only that they are zero or not.
_PROCESS_FACTS = re.compile(r".*_s$|.*_seconds$|frames_ok$|frames_total$")


def normalized(facts):
    """Facts with what differs between any two processes taken out (object addresses, temp paths, ports, wall
    times, dynamo's frame counts)."""
    if isinstance(facts, dict):
        return {k: normalized(v) for k, v in facts.items() if not (isinstance(k, str) and _PROCESS_FACTS.match(k))}
    if isinstance(facts, (list, tuple)):
        return [normalized(v) for v in facts]
    if isinstance(facts, str):
        return _VOLATILE.sub("<volatile>", facts)
    return facts


def differences(pooled, fresh, where: str = "") -> list[str]:
    """Where two facts differ (paths into the dicts), at most a few."""
    if isinstance(pooled, dict) and isinstance(fresh, dict):
        out = []
        for key in sorted(set(pooled) | set(fresh), key=str):
            if key not in pooled or key not in fresh:
                out.append(f"{where}.{key}: only in the {'pooled' if key in pooled else 'fresh'} run")
            else:
                out.extend(differences(pooled[key], fresh[key], f"{where}.{key}"))
        return out[:5]
    if isinstance(pooled, list) and isinstance(fresh, list) and len(pooled) == len(fresh):
        return [d for i, (a, b) in enumerate(zip(pooled, fresh)) for d in differences(a, b, f"{where}[{i}]")][:5]
    return [] if pooled == fresh else [f"{where}: pooled {pooled!r:.200} != fresh {fresh!r:.200}"]
