"""Every private torch / transformers / accelerate / Transformer Engine internal this package relies on (and
TE's version forks, decided once per installed TE), one module per library.

The fixes reach these internals only through the accessors here. A patch set lists the modules it needs
(``internals = [...]`` in its TOML); when it is applied, :func:`check` runs each module's ``check(versions)``
(the installed versions, read by the engine: nothing here imports ``engine/``), and a missing or changed
internal refuses the whole set with an error naming the internal and the installed version — never a crash
in the middle of ``prepare``. A library that is not installed has nothing to check.
"""

from __future__ import annotations

import importlib

MODULES = ("torch_fsdp2", "torch_internals", "torch_context_parallel", "transformers_tp", "transformers_ep",
           "accelerate_internals", "transformer_engine")
# the distributions whose installed versions check() needs (the engine reads them once, from metadata)
DISTRIBUTIONS = ("accelerate", "torch", "transformers", "transformer-engine")


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


def block_sha256(source: str, qualname: str) -> str | None:
    """First 16 hex digits of the sha256 of the ``def`` block ``qualname`` (``Class.method`` or ``function``) in
    ``source``: its ``def`` line to its last line (the next line indented no deeper ends it), decorators excluded,
    trailing blank lines dropped. None when there is no such block. Read as text, never imported; the block's
    statements are found with ``ast`` first, so a string with a line at column 0 does not end it early."""
    import hashlib

    lines = source.splitlines(keepends=True)
    *owners, name = qualname.split(".")
    start, indent = 0, ""
    for owner in owners:  # narrow to the class body
        for i in range(start, len(lines)):
            if lines[i].startswith(f"{indent}class {owner}(") or lines[i].startswith(f"{indent}class {owner}:"):
                start, indent = i + 1, indent + "    "
                break
        else:
            return None
    for i in range(start, len(lines)):
        if lines[i].startswith(f"{indent}def {name}(") or lines[i].startswith(f"{indent}async def {name}("):
            end = max(i + 1, _last_statement_line(source, i + 1))
            while end < len(lines) and (not lines[end].strip() or lines[end].startswith(indent + " ")
                                        or lines[end].startswith(indent + "\t")):
                end += 1
            block = lines[i:end]
            while block and not block[-1].strip():
                block.pop()
            return hashlib.sha256("".join(block).encode()).hexdigest()[:16]
    return None


def _last_statement_line(source: str, def_line: int) -> int:
    """The 1-based last line of the function whose ``def`` is on line ``def_line`` (0 when the source does not
    parse here): past any multi-line string, whatever its lines' indent."""
    import ast

    try:
        tree = ast.parse(source)
    except SyntaxError:
        return 0
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.lineno == def_line:
            return node.end_lineno or 0
    return 0


def changed_blocks(root, hashed: dict, version: str) -> list[str]:
    """Problems for each ``(file under root, qualname): {release: sha256}`` of ``hashed`` whose block is gone or
    hashes to none of the releases' — the check that tells "unchanged" from "still mentions a string"."""
    problems = []
    for (name, qualname), known in hashed.items():
        try:
            found = block_sha256((root / name).read_text(), qualname)
        except OSError:
            found = None
        if found is None:
            problems.append(f"{version}: {root.name}/{name}: {qualname} is gone")
        elif found not in known.values():
            problems.append(f"{version}: {root.name}/{name}: {qualname} changed (source sha256 {found}; written "
                            f"against {', '.join(f'{v} {h}' for v, h in sorted(known.items()))})")
    return problems


def package_root(name: str):
    """The folder of an installed package, found without importing it (None when absent)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec(name)
    return Path(spec.origin).parent if spec is not None and spec.origin is not None else None


def check_sources(package: str, versions, sources, subfolder: str = "") -> list[str]:
    """``check(versions)`` of an internals module whose internals are texts in ``package``'s source files:
    problems naming the version (the distribution is ``package``'s, e.g. torch, accelerate)."""
    version = f"{package} {versions.get(package)}"
    root = package_root(package)
    if root is None:
        return [f"{version}: {package} not found"]
    return missing_from_sources(root / subfolder if subfolder else root, sources, version)


def check(names, versions) -> list[str]:
    """Problems found in the named internals modules (empty when all are as expected); ``versions``: the
    installed version of each of :data:`DISTRIBUTIONS` (None when not installed)."""
    problems = []
    for name in names:
        if name not in MODULES:
            problems.append(f"unknown internals module {name!r} (known: {', '.join(MODULES)})")
            continue
        problems += importlib.import_module(f"{__name__}.{name}").check(versions)  # a loaded one: from sys.modules
    return problems
