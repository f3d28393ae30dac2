"""The GPU runner: the device commands, issued back to back while the machine stays warm (it goes back
after about 30 s idle, and the parts carried so far with it).

Command k (k < last) carries part k and the manifest and checks the part's sha256 on arrival (the first
one also records the machine and probes which backend can run several ranks on its one GPU). The last
carries the last part and the manifest, then reassembles, verifies, installs and runs every check
(``gpu_kit.gpu_run``) inside one command of at most 10 minutes. ``python -m gpu_kit plan`` prints them.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from gpu_kit.kit import MIB, PARTS_DIR, ROOT, load_manifest

COMMAND_LIMIT = 2000  # characters, per device command
CARRY_LIMIT = 8  # paths per device command
TRANSFER_LIMIT = 64 * MIB  # working tree + carried paths, per device command
# Device time (docs/gpu.md "The plan"): 15 minutes a session, the machine's start (one to three minutes) included.
# The plan's calls are limited to 8 minutes together, so that a slow start and one resumed pass still fit.
DEVICE_BUDGET_S = 900
SLOW_START_S = 180
GAP_S = 10  # between two calls issued back to back (the machine is held meanwhile)
PLAN_LIMIT_S = 480  # the sum of the plan's timeouts
PROBE_TIMEOUT_S = 75  # part 1 + the machine's facts + the 4-rank probe (cap 45 s)
PART_TIMEOUT_S = 30  # a carried part's sha256
RUN_TIMEOUT_S = 315
RUN_BUDGET_S = 290  # what gpu_run plans for inside RUN_TIMEOUT_S
RESUME_TIMEOUT_S = 180  # the optional second pass (run --resume) on the still-warm machine
RESUME_BUDGET_S = 160
# Without a built kit the plan is printed for the expected one: the bundle measured on 2026-11-30 (268.9 MiB) plus
# the [carried] wheels (20.35 MiB) is 289.3 MiB, five parts of at most 60 MiB (placeholder names).
EXPECTED_PARTS = 5


def _rel(path: Path) -> str:
    """A carried path: relative to the repository root (where the device command runs)."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def tree_bytes() -> int:
    """What travels with every command besides the carried paths: tracked and untracked-not-ignored files."""
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            capture_output=True, check=True).stdout.split(b"\0")
    return sum((ROOT / name.decode()).stat().st_size for name in listed if name and (ROOT / name.decode()).is_file())


def commands(manifest: dict | None = None, parts_dir: Path = PARTS_DIR) -> list[dict]:
    manifest = manifest or load_manifest(parts_dir / "manifest.json")
    parts = manifest["parts"]
    manifest_rel = _rel(parts_dir / "manifest.json")
    steps = []
    for index, part in enumerate(parts):
        carry = [_rel(parts_dir / part["name"]), manifest_rel]
        receive = f"python3 -m gpu_kit receive {index}"
        if index == len(parts) - 1:
            command = (f"{receive} && PYTHONUNBUFFERED=1 python3 -m gpu_kit run --out \"$OUT\" "
                       f"--budget {RUN_BUDGET_S}")
            purpose = ("last part; then the stages in order (gpu_kit.gpu_run.STAGES): "
                       + ", ".join(stage.name for stage in stages()))
            timeout = RUN_TIMEOUT_S
        elif index == 0:
            command = f"{receive} && PYTHONUNBUFFERED=1 python3 -m gpu_kit probe --out \"$OUT\""
            purpose = ("part 1; the machine's versions, and which collectives of the rank jobs gloo runs on CUDA "
                       "tensors (no TE needed)")
            timeout = PROBE_TIMEOUT_S
        else:
            command = receive
            purpose = f"part {index + 1}"
            timeout = PART_TIMEOUT_S
        steps.append({"step": index + 1, "command": command, "carry": carry, "timeout_s": timeout,
                      "carried_bytes": part["size"] + (parts_dir / "manifest.json").stat().st_size,
                      "purpose": purpose})
    steps.append({"step": len(steps) + 1, "command": f"PYTHONUNBUFFERED=1 python3 -m gpu_kit run --resume --out "
                  f"\"$OUT\" --budget {RESUME_BUDGET_S}", "carry": [], "timeout_s": RESUME_TIMEOUT_S,
                  "carried_bytes": 0, "optional": True,
                  "purpose": "only if device time is left and the machine is still warm (within ~30 s of the last "
                             "call): the stages the first pass did not reach (compile, the TP jobs, throughput)"})
    return steps


def stages():
    from gpu_kit.gpu_run import STAGES  # standard library only, as this module

    return STAGES


def budget(steps: list[dict]) -> dict:
    """The plan's device time: its calls' limits, a slow start, the gaps, the optional resumed pass."""
    required = [s for s in steps if not s.get("optional")]
    limits = sum(s["timeout_s"] for s in required)
    decisive = sum(stage.estimate for stage in stages() if stage.decisive)
    worst = SLOW_START_S + limits + GAP_S * len(steps) + sum(s["timeout_s"] for s in steps if s.get("optional"))
    return {"calls": len(required), "limits_s": limits, "decisive_estimate_s": decisive, "worst_case_s": worst,
            "device_budget_s": DEVICE_BUDGET_S}


def check(steps: list[dict], tree: int | None = None) -> list[str]:
    """Every limit the device tool sets on a command, checked; an empty list when all hold."""
    tree = tree_bytes() if tree is None else tree
    problems = []
    for step in steps:
        if len(step["command"]) > COMMAND_LIMIT:
            problems.append(f"step {step['step']}: command of {len(step['command'])} characters > {COMMAND_LIMIT}")
        if len(step["carry"]) > CARRY_LIMIT:
            problems.append(f"step {step['step']}: {len(step['carry'])} carried paths > {CARRY_LIMIT}")
        if tree + step["carried_bytes"] > TRANSFER_LIMIT:
            problems.append(f"step {step['step']}: working tree {tree / MIB:.1f} MiB + carried "
                            f"{step['carried_bytes'] / MIB:.1f} MiB > {TRANSFER_LIMIT / MIB:.0f} MiB")
        if step["timeout_s"] > 600:
            problems.append(f"step {step['step']}: timeout {step['timeout_s']} s > the tool's 600 s a command")
        for path in step["carry"]:
            if not (ROOT / path).exists():
                problems.append(f"step {step['step']}: carried path {path} does not exist")
    figures = budget(steps)
    if figures["limits_s"] > PLAN_LIMIT_S:
        problems.append(f"the calls' limits sum to {figures['limits_s']} s > {PLAN_LIMIT_S} s")
    if figures["worst_case_s"] > DEVICE_BUDGET_S:
        problems.append(f"a slow start, the calls, their gaps and the resumed pass take {figures['worst_case_s']} s > "
                        f"the {DEVICE_BUDGET_S} s of device time")
    if figures["decisive_estimate_s"] > RUN_BUDGET_S:
        problems.append(f"the decisive stages are estimated at {figures['decisive_estimate_s']} s > the run's budget "
                        f"of {RUN_BUDGET_S} s")
    if RUN_BUDGET_S + 20 > RUN_TIMEOUT_S or RESUME_BUDGET_S + 15 > RESUME_TIMEOUT_S:
        problems.append("a run's budget leaves less than its margin under the call's timeout")
    return problems


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m gpu_kit plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="the steps as JSON (command, carry, timeout_s)")
    args = parser.parse_args(argv)
    placeholder = not (PARTS_DIR / "manifest.json").is_file()
    if placeholder:  # not built here: the expected kit's commands (the check then names the absent parts)
        import tempfile

        parts_dir = Path(tempfile.mkdtemp(prefix="gpu_kit_plan_"))
        manifest = {"parts": [{"name": f"part-{i:02d}", "size": 60 * MIB} for i in range(EXPECTED_PARTS)]}
        (parts_dir / "manifest.json").write_text(json.dumps(manifest))
        steps = commands(manifest, parts_dir)
        for step in steps:  # the paths the built kit will have
            step["carry"] = [_rel(PARTS_DIR / Path(c).name) for c in step["carry"]]
    else:
        steps = commands()
    tree = tree_bytes()
    problems = check(steps, tree)
    if args.json:
        print(json.dumps({"steps": steps, "tree_bytes": tree, "problems": problems}, indent=1))
    else:
        figures = budget(steps)
        if placeholder:
            print(f"# (no kit built here: the plan of the expected kit, {EXPECTED_PARTS} parts; "
                  "python -m gpu_kit build makes it)")
        print(f"# {figures['calls']} device commands, back to back (the machine keeps the parts only while warm: "
              f"~30 s idle), limits {figures['limits_s']} s together; worst case with a {SLOW_START_S} s start, the "
              f"gaps and the resumed pass {figures['worst_case_s']} s of {DEVICE_BUDGET_S} s. Working tree "
              f"{tree / MIB:.2f} MiB travels with each.")
        for step in steps:
            print(f"\n## step {step['step']}{' (optional)' if step.get('optional') else ''}: {step['purpose']}")
            print(f"run(command={json.dumps(step['command'])}, carry={json.dumps(step['carry'])}, "
                  f"timeout_s={step['timeout_s']})")
        print(f"\n# The run's stages (budget {RUN_BUDGET_S} s; decisive ones estimated at "
              f"{figures['decisive_estimate_s']} s):")
        for stage in stages():
            print(f"- {stage.name}: ~{stage.estimate:.0f} s (cap {stage.cap:.0f} s)"
                  f"{'' if stage.decisive else ', if time is left'}: {stage.what}")
        for problem in problems:
            print(f"PROBLEM: {problem}")
    return 1 if problems else 0
