#!/usr/bin/env python3
"""The source hashes of the library functions the patch sets watch — what a new release's entry in their tables is
made from, after its tests passed:

- torch (``internals/torch_fsdp2.py``: ``HASHED``, ``FP8_ALL_GATHER_HASHED``), the default;
- transformers (``internals/transformers_features.py``: ``FEATURES``), with ``--transformers``.

    python scripts/source_hashes.py                                  # the torch this interpreter has (not imported)
    python scripts/source_hashes.py torch-2.16.0-...whl              # a downloaded wheel (pip download --no-deps torch==X)
    python scripts/source_hashes.py path/to/site-packages/torch
    python scripts/source_hashes.py --transformers                   # the installed transformers
    python scripts/source_hashes.py --transformers transformers-5.26.0-py3-none-any.whl
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from accel_fp8_fix.internals import block_sha256, package_root  # noqa: E402


def tree(where: str | None, package: str, scratch: Path) -> Path:
    """The ``package`` folder of an installed package, a source tree or a wheel (unpacked into ``scratch``)."""
    if where is None:
        root = package_root(package)
        if root is None:
            raise SystemExit(f"source_hashes: {package} is not installed here; give a wheel or a folder")
        return root
    path = Path(where)
    if path.suffix == ".whl":
        with zipfile.ZipFile(path) as wheel:
            sources = [n for n in wheel.namelist() if n.startswith(f"{package}/") and n.endswith(".py")]
            wheel.extractall(scratch, sources)
        return scratch / package
    if not path.is_dir():
        raise SystemExit(f"source_hashes: {where} is neither a wheel nor a folder")
    return path / package if (path / package).is_dir() else path


def rows(root: Path, tables: dict):
    """(table, file, qualname[ (anchor)], sha256 found, tested releases with that sha256) per watched block."""
    for table, entries in tables.items():
        for key, known in entries.items():
            name, qualname, *anchor = key
            file = root / name
            found = block_sha256(file.read_text(), qualname, *anchor) if file.exists() else None
            where = f"{qualname} ({anchor[0]!r})" if anchor else qualname
            yield table, name, where, found, [release for release, digest in known.items() if digest == found]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("where", nargs="?", help="a wheel, a site-packages folder or the package folder "
                                                 "(default: the installed package)")
    parser.add_argument("--transformers", action="store_true", help="the transformers internals, not torch's")
    args = parser.parse_args(argv)
    if args.transformers:
        from accel_fp8_fix.internals.transformers_features import FEATURES

        package, tables = "transformers", {name: blocks for name, (_, blocks) in FEATURES.items()}
    else:
        from accel_fp8_fix.internals.torch_fsdp2 import FP8_ALL_GATHER_HASHED, FSDP2_FOLDER, HASHED

        package = "torch"
        tables = {t: {(f"{FSDP2_FOLDER}/{name}", q): v for (name, q), v in e.items()}
                  for t, e in (("HASHED", HASHED), ("FP8_ALL_GATHER_HASHED", FP8_ALL_GATHER_HASHED))}
    with tempfile.TemporaryDirectory() as scratch:
        root = tree(args.where, package, Path(scratch))
        for table, name, where, found, same in rows(root, tables):
            verdict = ("= " + ", ".join(same) if same else
                       "GONE" if found is None else "NEW (no release recorded has it)")
            print(f"{table:22} {name:34} {where:50} {found or '-':16}  {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
