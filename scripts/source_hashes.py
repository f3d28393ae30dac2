#!/usr/bin/env python3
"""The source hashes of the torch functions the patch sets watch (``internals/torch_fsdp2.py``: ``HASHED``,
``FP8_ALL_GATHER_HASHED``), for an installed torch, a torch source tree or a wheel — what a new release's entry
in those tables is made from, after its matrix run passed.

    python scripts/source_hashes.py                          # the torch this interpreter imports (not imported)
    python scripts/source_hashes.py torch-2.16.0-...whl      # a downloaded wheel (pip download --no-deps torch==X)
    python scripts/source_hashes.py path/to/site-packages/torch
"""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from accel_fp8_fix.internals import block_sha256, package_root  # noqa: E402
from accel_fp8_fix.internals.torch_fsdp2 import FP8_ALL_GATHER_HASHED, FSDP2_FOLDER, HASHED  # noqa: E402


def read(where: str | None, name: str) -> str:
    if where and where.endswith(".whl"):
        with zipfile.ZipFile(where) as wheel:
            return wheel.read(f"torch/{FSDP2_FOLDER}/{name}").decode()
    root = Path(where) if where else package_root("torch")
    return (root / FSDP2_FOLDER / name).read_text()


def main(argv: list[str]) -> int:
    where = argv[0] if argv else None
    for table, entries in (("HASHED", HASHED), ("FP8_ALL_GATHER_HASHED", FP8_ALL_GATHER_HASHED)):
        for name, qualname in entries:
            found = block_sha256(read(where, name), qualname)
            known = entries[(name, qualname)]
            same = [release for release, digest in known.items() if digest == found]
            print(f"{table:22} {name:22} {qualname:34} {found}  "
                  f"{'= ' + ', '.join(same) if same else 'NEW (no release recorded has it)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
