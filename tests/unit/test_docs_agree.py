"""Docs that cannot drift (issue 46 item 4): every figure or list a document restates from the code or the
declarations is checked here against its source, so a change that makes one wrong fails the suite instead of
waiting for a reviewer. What is checked: the version windows (patches/*.toml), the module maps
(docs/architecture.md against the package's files), every repository path a document names, the failure labels
(docs/failures.md against docs/fixes.md, and the table rows' promised length), the token multiples README states
(fixes/convert/fp8_shapes.py), the settings table (tests/unit/test_settings.py), and the line count a map claims.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "accel_fp8_fix"
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
FAILURE_ROW_LIMIT = 700  # characters: docs/failures.md keeps a row short, the detail in docs/fixes.md


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


# -- version windows --------------------------------------------------------------------------------------------
def _window(spec: str) -> tuple[str, str]:
    """">=1.13,<1.17" -> ("1.13", "1.16"): the first and the last minor a window holds."""
    low = re.search(r">=\s*(\d+)\.(\d+)", spec)
    high = re.search(r"<\s*(\d+)\.(\d+)", spec)
    return f"{low[1]}.{low[2]}", f"{high[1]}.{int(high[2]) - 1}"


def _declared() -> dict:
    sets = [tomllib.loads(_text(p)) for p in sorted((ROOT / "patches").glob("accelerate-*.toml"))]
    assert len(sets) == 1, "one runtime patch set: extend this test when a second window appears"
    declared = sets[0]
    return {"accelerate": _window(declared["requires"]["accelerate"]), "torch": _window(declared["requires"]["torch"]),
            "transformers": _window(declared["tested"]["transformers"]), "name": declared["name"],
            "specs": {**declared["requires"], **declared["compatible"], **declared["tested"]}}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_the_version_windows_a_document_quotes_are_the_patch_sets(doc):
    declared = _declared()
    text = _text(doc)
    def minor(v: str) -> tuple:
        return tuple(map(int, v.split(".")))

    for library in ("accelerate", "torch"):
        first, last = map(minor, declared[library])
        for low, high in re.findall(rf"\b{library} (\d+\.\d+)\s*(?:–|-|to)\s*(\d+\.\d+)\b", text):
            if minor(high) < first or minor(low) > last:  # a statement about releases outside the window
                continue
            assert (low, high) == declared[library], (
                f"{doc.name} says {library} {low}–{high}; patches/ declare {'–'.join(declared[library])}")
    for name in re.findall(r"`(accelerate-\d+\.\d+-\d+\.\d+)`", text):
        assert name == declared["name"], f"{doc.name} names the patch set {name}; patches/ hold {declared['name']}"


def test_the_readme_support_table_is_the_declared_windows():
    declared = _declared()
    row = next(line for line in _text(ROOT / "README.md").splitlines() if line.startswith(f"| `{declared['name']}`"))

    def shown(spec: str) -> str:
        return ", ".join(part.replace(">=", "≥").replace("<", "<") for part in spec.split(","))

    for library in ("accelerate", "torch", "transformers"):
        assert shown(declared["specs"][library]) in row, (library, row)


# -- module maps ------------------------------------------------------------------------------------------------
MAPPED = ("fixes", "fixes/start", "fixes/convert", "fixes/all_gather", "fixes/checkpoint", "fixes/step", "diagnostics",
          "distributed", "engine", "internals", "internals/transformer_engine", "rehearsal", "rehearsal/te_on_cpu")


def _modules(folder: str) -> list[str]:
    return sorted(p.stem for p in (PACKAGE / folder).glob("*.py") if p.stem != "__init__" and not p.stem.startswith("_"))


@pytest.mark.parametrize("folder", MAPPED)
def test_the_architecture_map_names_every_module(folder):
    text = _text(ROOT / "docs" / "architecture.md")
    missing = [m for m in _modules(folder) if not re.search(rf"\b{re.escape(m)}(?:\.py)?\b", text)]
    assert not missing, f"docs/architecture.md's map leaves out accel_fp8_fix/{folder}/: {missing}"


def test_every_module_the_architecture_map_names_exists():
    text = _text(ROOT / "docs" / "architecture.md")
    start = text.index("accel_fp8_fix/")
    tree = text[start:text.index("```", start)]  # the map: the first code block's tree
    named = set(re.findall(r"\b(\w+)\.py\b", tree))
    existing = {p.stem for top in ("accel_fp8_fix", "gpu_kit", "scripts", "benchmarks", "tests", "examples")
                for p in (ROOT / top).rglob("*.py")}
    assert not named - existing, f"docs/architecture.md names modules that do not exist: {sorted(named - existing)}"


# -- paths -----------------------------------------------------------------------------------------------------
_TOP = ("accel_fp8_fix", "tests", "scripts", "benchmarks", "gpu_kit", "patches", "docs", "examples", "packaging",
        ".ci")
_SUB = ("fixes", "internals", "diagnostics", "distributed", "engine", "testing", "rehearsal")
_PATH = re.compile(rf"(?<![\w/.])((?:{'|'.join(map(re.escape, _TOP + _SUB))})/[\w./-]*\w)")


def _resolves(path: str) -> bool:
    path = path.split("::")[0].rstrip(".")
    candidates = [ROOT / path, PACKAGE / path, PACKAGE / "rehearsal" / path, ROOT / "tests" / path]
    return any(c.exists() or c.with_suffix(".py").exists() for c in candidates)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)  # not CHANGELOG.md: history names what was then
def test_every_repository_path_a_document_names_exists(doc):
    spans = [s for s in re.findall(r"`([^`\n]+)`", _text(doc)) if not re.search(r"[*<>{}]|\.\.\.", s)]
    named = {m for span in spans for m in _PATH.findall(span)}
    dangling = sorted(p for p in named if not _resolves(p))
    assert not dangling, f"{doc.name} names paths that do not exist: {dangling}"


# -- failure labels ---------------------------------------------------------------------------------------------
def _failure_rows() -> dict[str, str]:
    rows = {}
    for line in _text(ROOT / "docs" / "failures.md").splitlines():
        found = re.match(r"\|\s*(A\d+)\s*\|", line)
        if found:
            rows[found[1]] = line
    return rows


def test_fixes_md_names_the_labels_failures_md_defines():
    labels = sorted(_failure_rows(), key=lambda a: int(a[1:]))
    assert labels == [f"A{i}" for i in range(1, len(labels) + 1)], labels  # one row a label, none skipped
    said = re.search(r"Labels \(A1…A(\d+)\)", _text(ROOT / "docs" / "fixes.md"))
    assert said and int(said[1]) == len(labels), f"docs/fixes.md says A1…A{said and said[1]}; failures.md has {labels[-1]}"


@pytest.mark.parametrize("label", sorted(_failure_rows(), key=lambda a: int(a[1:])))
def test_a_failures_md_row_is_short(label):
    row = _failure_rows()[label]
    assert len(row) <= FAILURE_ROW_LIMIT, (
        f"docs/failures.md {label} is {len(row)} characters (> {FAILURE_ROW_LIMIT}): the detail goes to docs/fixes.md")


# -- figures ------------------------------------------------------------------------------------------------------
def test_the_readme_states_the_token_multiples_the_check_asks():
    from accel_fp8_fix.fixes.convert import fp8_shapes

    limits = _text(ROOT / "README.md").split("## Limits", 1)[1]
    bullet = next(b for b in limits.split("\n- ") if "token count" in b)
    numbers = {int(n) for n in re.findall(r"multiple of (\d+)", bullet)}
    numbers |= {int(n) for n in re.findall(r"pad_to_multiple_of=(\d+)", bullet)}
    assert numbers == {fp8_shapes.FP8_LEADING_MULTIPLE, fp8_shapes.WGRAD_TOKENS_MULTIPLE}, bullet


def test_the_line_counts_the_architecture_map_claims():
    claims, folder = [], None
    for line in _text(ROOT / "docs" / "architecture.md").splitlines():  # a map entry: "  name/   text..." + indented
        entry = re.match(r"^  (\w+)/\s", line)
        folder = entry[1] if entry else (folder if line.startswith("     ") else None)
        claims += [(folder, n) for n in re.findall(r"~([\d.]+) k lines", line) if folder]
    assert claims, "no line count claimed: drop this test with the claim"
    for folder, thousands in claims:
        lines = sum(len(p.read_text().splitlines()) for p in (PACKAGE / folder).rglob("*.py"))
        assert abs(lines - float(thousands) * 1000) <= 0.25 * lines, (folder, lines, thousands)


# -- the layer table's imports ------------------------------------------------------------------------------------
def _component(path: Path) -> str:
    rel = path.relative_to(PACKAGE).parts
    return rel[0][:-3] if len(rel) == 1 else rel[0]


def _imported_components(component: str) -> set[str]:
    """Every package component ``component``'s modules import (function-level imports too), itself left out."""
    import ast

    files = [PACKAGE / f"{component}.py"] if (PACKAGE / f"{component}.py").is_file() else \
        sorted((PACKAGE / component).rglob("*.py"))
    found = set()
    for path in files:
        package = path.relative_to(ROOT).with_suffix("").parts[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = list(package[: len(package) - node.level + 1]) if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                names = [module] if node.module else [f"{module}.{a.name}" for a in node.names]
                if node.module and module == "accel_fp8_fix":
                    names = [f"accel_fp8_fix.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[0] != "accel_fp8_fix":
                    continue
                top = parts[1] if len(parts) > 1 else "__init__"
                if not ((PACKAGE / top).is_dir() or (PACKAGE / f"{top}.py").is_file()):
                    top = "__init__"  # a name the package's __init__ exports
                found.add(top)
    return found - {component}


def _layer_rows() -> dict[str, str]:
    """{"a, b": what the row says they import}: a row may hold several components ("`cli`, `__main__`")."""
    text = _text(ROOT / "docs" / "architecture.md").split("## Layers", 1)[1]
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            rows[", ".join(re.findall(r"`(\w+)`", cells[0]))] = cells[2]
    return rows


@pytest.mark.parametrize("row", sorted(_layer_rows()))
def test_the_layer_table_lists_what_each_layer_imports(row):
    """A row whose imports are a plain list must name exactly what the layer's modules import; a row written as a
    range ("`settings` to `engine` ...", "... and below") must name only what it imports (test_layout.py checks that
    nothing comes from above)."""
    said, own = _layer_rows()[row], set(row.split(", "))
    listed = set(re.findall(r"`(\w+)`", said)) - own
    actual = set().union(*(_imported_components(layer) for layer in own)) - own
    layer = row
    if said == "nothing":
        assert actual == set(), (layer, actual)
    elif re.search(r"\bto\b|and below|lazily|other ", said):
        assert listed <= actual | {"__init__"}, (layer, said, actual)
    else:
        assert listed == actual, f"docs/architecture.md says {layer} imports {sorted(listed)}; it imports {sorted(actual)}"


@pytest.mark.parametrize("model", ["llama", "moe"])
def test_docs_convergence_shows_the_committed_results(model):
    """docs/convergence.md's table of each model is the one benchmarks/convergence.py wrote with the committed CSV
    and picture (``--write-docs`` puts it there)."""
    results = ROOT / "benchmarks" / "results" / "convergence"
    text = (ROOT / "docs" / "convergence.md").read_text()
    block = text.split(f"<!-- results:{model} -->\n", 1)[1].split(f"\n<!-- /results:{model} -->", 1)[0]
    assert block == (results / f"{model}.md").read_text().rstrip("\n")
    assert (results / f"{model}.csv").exists() and (results / f"{model}.png").exists()
