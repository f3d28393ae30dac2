#!/usr/bin/env python3
"""The registry's newest releases against the declared windows and the suite's pins (for every closing note).

    python scripts/newest_releases.py            # a markdown table; exit 0 whatever it finds (a release is news)
    python scripts/newest_releases.py --json     # the same rows as JSON

The registry is asked past this machine's local pip cap (``PIP_CONFIG_FILE`` left out: this image's global
constraint file hides torch > 2.14.1 from ``pip index``). A row's *window* column is what each patch set declares
(``patches/*.toml`` ``[requires]`` / ``[compatible]``, and ``[tested]`` for transformers: outside it the set still
applies and serves what its source hashes verify); *pinned* is what ``scripts/setup.sh`` installs for the suite.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from packaging.version import InvalidVersion, Version

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
DISTRIBUTIONS = ["torch", "accelerate", "transformers", "transformer-engine"]


def registry_versions(dist: str, timeout: float = 90) -> list[Version] | str:
    """Every final release the registry serves, newest first; or why it could not be read."""
    cmd = [sys.executable, "-m", "pip", "index", "versions", dist, "--disable-pip-version-check"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "PIP_CONFIG_FILE": os.devnull})
    except (subprocess.TimeoutExpired, OSError) as exc:
        return f"registry unreachable: {exc}"
    found = re.search(r"Available versions: (.*)", proc.stdout)
    if proc.returncode != 0 or not found:
        return f"registry unreachable: {(proc.stderr or proc.stdout).strip()[-200:]}"
    versions = set()
    for text in found.group(1).split(","):
        try:
            version = Version(text.strip())
        except InvalidVersion:
            continue
        if not version.is_prerelease and not version.is_devrelease:
            versions.add(Version(version.base_version))  # 2.13.0+cpu is 2.13.0
    return sorted(versions, reverse=True)


def suite_pins() -> dict[str, str]:
    text = (REPO / "scripts" / "setup.sh").read_text()
    return dict(re.findall(r'"([a-z-]+)==([0-9][0-9.]*)"', text))


def rows() -> list[dict]:
    from accel_fp8_fix.engine import load_patch_sets

    sets = load_patch_sets()
    pins = suite_pins()
    out = []
    for dist in DISTRIBUTIONS:
        released = registry_versions(dist)
        newest = released[0] if isinstance(released, list) and released else None
        windows = {s.name: s.requires.get(dist) or s.compatible.get(dist) or s.tested.get(dist) for s in sets}
        windows = {name: spec for name, spec in windows.items() if spec is not None}
        inside = {name: spec.contains(newest) for name, spec in windows.items()} if newest else {}
        out.append({"distribution": dist, "newest": str(newest) if newest else released,
                    "pinned": pins.get(dist), "windows": {name: str(spec) for name, spec in windows.items()},
                    "newest_inside": inside})
    return out


def table(found: list[dict]) -> str:
    lines = ["| distribution | registry's newest | suite's pin | declared windows | newest inside |",
             "|---|---|---|---|---|"]
    for row in found:
        windows = "; ".join(f"`{name}` {spec}" for name, spec in row["windows"].items()) or "(none declared)"
        inside = row["newest_inside"]
        verdict = ("yes" if inside and all(inside.values()) else
                   "**no**: " + ", ".join(n for n, ok in inside.items() if not ok) if inside else "-")
        lines.append(f"| {row['distribution']} | {row['newest']} | {row['pinned'] or '-'} | {windows} | {verdict} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    found = rows()
    print(json.dumps(found, indent=2) if args.json else table(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
