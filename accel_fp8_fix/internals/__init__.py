"""Every private torch / transformers / accelerate / Transformer Engine internal this package relies on (and
TE's version forks, decided once per installed TE), one module per library.

The fixes reach these internals only through the accessors here. A patch set lists the modules it needs
(``internals = [...]`` in its TOML); when it is applied, :func:`check` runs each module's ``check(versions)``
(the installed versions, read by the engine: nothing here imports ``engine/``), and a missing or changed
internal refuses the whole set with an error naming the internal and the installed version — never a crash
in the middle of ``prepare``. A library that is not installed has nothing to check. transformers' internals are
the exception: checked by source hash per feature (``transformers_features``), they never refuse the set, and
``prepare`` refuses by name what a model would use of one that changed.
"""

from __future__ import annotations

import importlib

MODULES = ("torch_fsdp2", "torch_internals", "torch_context_parallel", "transformers_features",
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


def block_sha256(source: str, qualname: str, anchor: str | None = None) -> str | None:
    """First 16 hex digits of the sha256 of the ``def`` block ``qualname`` (``Class.method`` or ``function``) in
    ``source``: its ``def`` line to its last line (the next line indented no deeper ends it), decorators excluded,
    trailing blank lines dropped. With ``anchor``: of the one statement inside that block whose first line contains
    ``anchor`` (an ``if`` chain with its ``elif`` / ``else``: the hand-off a fix relies on inside a long method).
    None when there is no such block or statement. Read as text, never imported; the block is checked with ``ast``
    (the file parsed whole only when the block alone does not parse: a string with a line at column 0)."""
    import hashlib

    lines = source.splitlines(keepends=True)
    found = _def_block(source, lines, qualname)
    if found is None:
        return None
    start, end, tree = found
    if anchor is not None:
        span = _statement_span(tree, lines[start:end], anchor)
        if span is None:
            return None
        start, end = start + span[0] - 1, start + span[1]
    block = lines[start:end]
    while block and not block[-1].strip():
        block.pop()
    return hashlib.sha256("".join(block).encode()).hexdigest()[:16]


def _def_block(source: str, lines: list, qualname: str):
    """(first line index, end index, ast of the dedented block) of the ``def`` ``qualname``, or None."""
    import ast
    import textwrap

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
            end = _indented_end(lines, i + 1, indent)
            try:
                tree = ast.parse(textwrap.dedent("".join(lines[i:end])))
            except SyntaxError:  # a multi-line string reaching column 0 ended it early: ask the whole file
                end = _indented_end(lines, max(i + 1, _last_statement_line(source, i + 1)), indent)
                try:
                    tree = ast.parse(textwrap.dedent("".join(lines[i:end])))
                except SyntaxError:
                    tree = None
            return i, end, tree
    return None


def _indented_end(lines: list, end: int, indent: str) -> int:
    while end < len(lines) and (not lines[end].strip() or lines[end].startswith(indent + " ")
                                or lines[end].startswith(indent + "\t")):
        end += 1
    return end


def _statement_span(tree, block: list, anchor: str):
    """(first, last) 1-based lines, in ``block``, of the first statement (in source order) whose first line contains
    ``anchor``; None when none does."""
    import ast

    if tree is None:
        return None
    statements = sorted((node for node in ast.walk(tree) if isinstance(node, ast.stmt)), key=lambda n: n.lineno)
    for node in statements:
        if anchor in block[node.lineno - 1]:
            return node.lineno, node.end_lineno
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
    """Problems for each ``(file under root, qualname[, anchor]): {release: sha256}`` of ``hashed`` whose block (or
    anchored statement) is gone or hashes to none of the releases' — the check that tells "unchanged" from "still
    mentions a string". Each file is read once."""
    return [problem for problem, _ in hashed_blocks(root, hashed, version).values() if problem]


def hashed_blocks(root, hashed: dict, version: str, texts: dict | None = None) -> dict:
    """{key: (problem or "", the releases whose sha256 the block has)} for each entry of ``hashed`` (as
    :func:`changed_blocks`); ``texts``: file contents already read, shared between calls."""
    texts = {} if texts is None else texts
    out = {}
    for key, known in hashed.items():
        name, qualname, *anchor = key
        if name not in texts:
            try:
                texts[name] = (root / name).read_text()
            except OSError:
                texts[name] = None
        found = block_sha256(texts[name], qualname, *anchor) if texts[name] is not None else None
        where = f"{qualname} ({anchor[0]!r})" if anchor else qualname
        releases = {release for release, sha in known.items() if sha == found}
        problem = ""
        if found is None:
            problem = f"{version}: {root.name}/{name}: {where} is gone"
        elif not releases:
            problem = (f"{version}: {root.name}/{name}: {where} changed (source sha256 {found}; written against "
                       f"{', '.join(f'{v} {h}' for v, h in sorted(known.items()))})")
        out[key] = (problem, releases)
    return out


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
