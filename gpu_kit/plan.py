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
RUN_BUDGET_S = 530  # what gpu_run plans for; the command's own limit is 600
RUN_TIMEOUT_S = 600


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
            purpose = ("last part; reassemble + verify + pip install --no-index --no-deps --target; import TE and "
                       "its FP8 support; tests/gpu; several ranks on the one GPU (FSDP2, FSDP2 x TP); throughput")
            timeout = RUN_TIMEOUT_S
        elif index == 0:
            command = f"{receive} && PYTHONUNBUFFERED=1 python3 -m gpu_kit probe --out \"$OUT\""
            purpose = "part 1; the machine's versions, and which backend runs two ranks on one GPU (no TE needed)"
            timeout = 180
        else:
            command = receive
            purpose = f"part {index + 1}"
            timeout = 60
        steps.append({"step": index + 1, "command": command, "carry": carry, "timeout_s": timeout,
                      "carried_bytes": part["size"] + (parts_dir / "manifest.json").stat().st_size,
                      "purpose": purpose})
    return steps


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
        for path in step["carry"]:
            if not (ROOT / path).exists():
                problems.append(f"step {step['step']}: carried path {path} does not exist")
    return problems


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m gpu_kit plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="the steps as JSON (command, carry, timeout_s)")
    args = parser.parse_args(argv)
    steps = commands()
    tree = tree_bytes()
    problems = check(steps, tree)
    if args.json:
        print(json.dumps({"steps": steps, "tree_bytes": tree, "problems": problems}, indent=1))
    else:
        print(f"# {len(steps)} device commands, back to back (the machine keeps the parts only while warm: ~30 s "
              f"idle). Working tree {tree / MIB:.2f} MiB travels with each.")
        for step in steps:
            print(f"\n## step {step['step']}: {step['purpose']}")
            print(f"run(command={json.dumps(step['command'])}, carry={json.dumps(step['carry'])}, "
                  f"timeout_s={step['timeout_s']})")
        for problem in problems:
            print(f"PROBLEM: {problem}")
    return 1 if problems else 0
