"""Every private torch / transformers / accelerate internal this package relies on, one module per library.

The fixes reach these internals only through the accessors here. A patch set lists the modules it needs
(``internals = [...]`` in its TOML); when it is applied, :func:`check` runs each module's ``check()``, and a
missing or changed internal refuses the whole set with an error naming the internal and the installed
version — never a crash in the middle of ``prepare``. A library that is not installed has nothing to check.
"""

from __future__ import annotations

import importlib

MODULES = ("torch_fsdp2", "transformers_tp", "accelerate_internals")


def check(names) -> list[str]:
    """Problems found in the named internals modules (empty when all are as expected)."""
    problems = []
    for name in names:
        if name not in MODULES:
            problems.append(f"unknown internals module {name!r} (known: {', '.join(MODULES)})")
            continue
        problems += importlib.import_module(f"{__name__}.{name}").check()
    return problems
