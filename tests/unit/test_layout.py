"""The house rules a reader relies on, checked on the source (docs/architecture.md, CONTRIBUTING.md):

* a fix is one file in ``fixes/`` plus its lines in ``patches/*.toml``: every wrapper a fix set declares is a
  function of ``accel_fp8_fix.fixes``; cross-cutting hooks (``on_error``, ``on_return``) are declared, not
  imported by the fixes;
* the arrows run one way: ``fixes/`` never imports ``diagnostics/`` or the public API (``_api``);
  ``internals/`` imports nothing from ``engine/``;
* Transformer Engine's private names are used only in ``internals/`` (and by the rehearsal, which stands in
  for TE's kernels);
* no function is longer than 80 lines.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "accel_fp8_fix"
MAX_FUNCTION_LINES = 80


def _modules(folder: str = ""):
    root = PACKAGE / folder if folder else PACKAGE
    for path in sorted(root.rglob("*.py")):
        yield path, ast.parse(path.read_text(), filename=str(path))


def _imported(tree: ast.Module, path: Path) -> set[str]:
    """Absolute names of the modules ``tree`` imports (relative imports resolved against ``path``)."""
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)
    return out


@pytest.mark.parametrize("folder, forbidden", [
    ("fixes", ("accel_fp8_fix.diagnostics", "accel_fp8_fix._api")),
    ("internals", ("accel_fp8_fix.engine",)),
])
def test_imports_run_one_way(folder, forbidden):
    wrong = {
        f"{path.relative_to(PACKAGE.parent)} imports {name}"
        for path, tree in _modules(folder)
        for name in _imported(tree, path)
        if name.startswith(forbidden)
    }
    assert not wrong, sorted(wrong)


def test_every_fix_wrapper_is_a_function_of_fixes():
    from accel_fp8_fix.engine.declarations import load_patch_sets

    for patch_set in load_patch_sets():
        home = "accel_fp8_fix.fixes." if patch_set.kind == "fix" else "accel_fp8_fix.rehearsal."
        for spec in patch_set.patches:
            if not spec.wrapper:
                assert spec.notes, spec.target  # a pass-through patch exists only for its error notes
                continue
            module, _, name = spec.wrapper.partition(":")
            assert module.startswith(home), f"{patch_set.name}: {spec.target} -> {spec.wrapper}"
            assert callable(getattr(importlib.import_module(module), name))
        for hook in [patch_set.on_error] + [spec.on_return for spec in patch_set.patches]:
            if hook:
                module, _, name = hook.partition(":")
                assert callable(getattr(importlib.import_module(module), name)), hook


def _te_private(name: str) -> bool:
    parts = name.split(".")
    return parts[0] == "transformer_engine" and any(p.startswith("_") for p in parts[1:])


def test_transformer_engine_private_names_only_in_internals():
    wrong = set()
    for path, tree in _modules():
        relative = path.relative_to(PACKAGE)
        if relative.parts[0] in ("internals", "rehearsal"):
            continue
        for name in _imported(tree, path):
            if _te_private(name):
                wrong.add(f"{relative}: {name}")
        for node in ast.walk(tree):  # importlib.import_module("transformer_engine....")
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and _te_private(node.value):
                wrong.add(f"{relative}:{node.lineno}: {node.value!r}")
    assert not wrong, sorted(wrong)


def test_no_function_is_longer_than_80_lines():
    long = []
    for path, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} ({length} lines)")
    assert not long, long


def test_docs_fixes_table_names_every_patched_target_and_its_module():
    from accel_fp8_fix.engine.declarations import load_patch_sets

    text = (PACKAGE.parent / "docs" / "fixes.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    (fix_set,) = [s for s in load_patch_sets() if s.kind == "fix"]
    for spec in fix_set.patches:
        owner_attr = spec.attribute
        attr = owner_attr.rsplit(".", 1)[-1]
        row = [r for r in rows if f"`{owner_attr}`" in r or f"`{attr}`" in r.split("|")[1]]
        assert row, f"docs/fixes.md has no row for {spec.target}"
        if spec.wrapper:
            module = spec.wrapper.partition(":")[0].removeprefix("accel_fp8_fix.").replace(".", "/") + ".py"
            assert any(f"`{module}`" in r for r in row), f"docs/fixes.md: {spec.target} row does not name {module}"


def test_one_install_instruction_for_the_rehearsal():
    from accel_fp8_fix import settings

    root = PACKAGE.parent
    for doc in ("README.md", "docs/rehearsal.md"):
        text = (root / doc).read_text()
        assert settings.REHEARSAL_INSTALL in text, doc
        assert "pip install accel-fp8-fix-rehearsal" not in text and "accel_fp8_fix[rehearsal]" not in text, doc
    assert "settings.REHEARSAL_INSTALL" in (PACKAGE / "_bootstrap.py").read_text()
