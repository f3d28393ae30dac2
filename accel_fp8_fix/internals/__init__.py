"""Every private torch / transformers / accelerate internal this package relies on, one module per library.

The fixes reach these internals only through the accessors here. A patch set lists the modules it needs
(``internals = [...]`` in its TOML); when it is applied, :func:`check` runs each module's ``check()``, and a
missing or changed internal refuses the whole set with an error naming the internal and the installed
version — never a crash in the middle of ``prepare``. A library that is not installed has nothing to check.
"""

from __future__ import annotations

import importlib

MODULES = ("torch_fsdp2", "transformers_tp", "accelerate_internals")


def missing_from_sources(root, sources, version: str) -> list[str]:
    """Problems for each ``(file under root, text)`` of ``sources`` whose file or text is gone — internals
    checked by reading the library's source, not importing it (importing FSDP2 costs ~1 s)."""
    problems = []
    for name, text in sources:
        try:
            source = (root / name).read_text()
        except OSError:
            problems.append(f"{version}: {root.name}/{name} is gone")
            continue
        if text not in source:
            problems.append(f"{version}: internal {text!r} is gone from {root.name}/{name}")
    return problems


def package_root(name: str):
    """The folder of an installed package, found without importing it (None when absent)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec(name)
    return Path(spec.origin).parent if spec is not None and spec.origin is not None else None


def check(names) -> list[str]:
    """Problems found in the named internals modules (empty when all are as expected)."""
    problems = []
    for name in names:
        if name not in MODULES:
            problems.append(f"unknown internals module {name!r} (known: {', '.join(MODULES)})")
            continue
        problems += importlib.import_module(f"{__name__}.{name}").check()
    return problems
