"""The house rules a reader relies on, checked on the source (docs/architecture.md, CONTRIBUTING.md):

* a fix is one file in a room of ``fixes/`` plus its lines in ``patches/*.toml``: every wrapper a fix set declares is
  a function of ``accel_fp8_fix.fixes``; cross-cutting hooks (``on_error``, ``on_return``) are declared, not
  imported by the fixes;
* no import cycle: the module graph of every import statement (those inside functions too) has no circle;
* the arrows run one way, down the layer order of docs/architecture.md (``LAYERS``): a module imports only from
  its own layer or below — so ``settings`` imports nothing from the package but ``caches``, ``internals/`` nothing from
  ``engine/``, ``fixes/`` never ``diagnostics/`` or the public API (``_api``); inside ``fixes/`` the rooms
  (``ROOMS``) one way too: ``start`` <- ``convert`` <- ``all_gather`` / ``checkpoint`` / ``step`` <- the spine;
* collectives go through the family, ``distributed/``: no direct ``torch.distributed`` collective call elsewhere
  (the rehearsal's stand-ins for TE's C++ all-reduce and the test bed's own barrier are outside the rule);
* Transformer Engine's private names, its FP8-state attributes, its ``_extra_state`` schema and its scale formula
  are used only in ``internals/`` (and by the rehearsal, which stands in for TE's kernels);
* no function is longer than 80 lines;
* the runtime wheel leaves the suite's rank pools out (pyproject's exclude) and nothing it keeps imports them.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "accel_fp8_fix"
MAX_FUNCTION_LINES = 80

# The layer order of docs/architecture.md, bottom first: a package (or top-level module) per entry, named by its
# first path part under accel_fp8_fix/ ("__init__": the package's own __init__.py).
LAYERS = (
    ("caches",),  # where every module-level cache registers its reset: imports nothing from the package
    ("settings",),  # the registry every layer reads: imports only caches
    ("_log",),
    ("internals",),
    ("distributed",),
    ("engine",),
    ("fixes",),
    ("_api",),
    ("diagnostics",),
    ("cli", "__main__"),
    ("rehearsal",),
    ("testing",),
    ("__init__",),
    ("_bootstrap",),
)
# The rooms of fixes/ (docs/architecture.md), by the moment of a run, bottom first: a fix imports only from its own
# room or an earlier row; the rooms of one row do not import each other. The spine (fixes/prepare.py, and
# fixes/trainer.py, which defers prepare_model to it) runs every room's piece, so it sits above them all.
ROOMS = (
    ("start",),  # settled before any model: Accelerator(), process start and exit
    ("convert",),  # what prepare does to the sharded model
    ("all_gather", "checkpoint", "step"),  # the FP8 all-gather, save / load, during a step
    ("spine",),  # SPINE: the modules at fixes/'s top
)
SPINE = ("prepare", "trainer")
# The family (distributed/collectives.py) names its group and refuses a DTensor; these go around it.
COLLECTIVE_CALLS = frozenset({
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_coalesced",
    "all_gather_object", "_all_gather_base", "all_to_all", "all_to_all_single", "broadcast", "broadcast_object_list",
    "reduce", "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "gather", "gather_object",
    "scatter", "scatter_object_list", "barrier", "monitored_barrier", "send", "recv", "isend", "irecv",
    "batch_isend_irecv", "new_group", "new_subgroups",
})
TORCH_DISTRIBUTED = ("torch.distributed", "torch.distributed.distributed_c10d",
                     "torch.distributed._functional_collectives")
OUTSIDE_THE_COLLECTIVE_RULE = ("distributed", "rehearsal", "testing")


def _modules(folder: str = ""):
    root = PACKAGE / folder if folder else PACKAGE
    for path in sorted(root.rglob("*.py")):
        yield path, ast.parse(path.read_text(), filename=str(path))


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.Module, path: Path):
    """(line, module, names) of every import statement in ``tree``, relative imports resolved against ``path``:
    ``import a.b`` -> ``(line, "a.b", ())``, ``from m import x, y`` -> ``(line, "m", ("x", "y"))``."""
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, ()
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            yield node.lineno, base, tuple(alias.name for alias in node.names)


def _imported(tree: ast.Module, path: Path) -> set[str]:
    """Absolute names of the modules ``tree`` imports (``from m import x``: ``m`` and ``m.x``)."""
    return {name for _line, module, names in _imports(tree, path)
            for name in (module, *(f"{module}.{n}" for n in names))}


def _import_graph() -> dict:
    """{module: {imported module of the package: [(file, line), ...]}}: each import resolved to the most specific
    module it names (``from accel_fp8_fix import settings`` -> ``accel_fp8_fix.settings``)."""
    trees = {_module_name(path): (path, tree) for path, tree in _modules()}
    graph = {}
    for module, (path, tree) in trees.items():
        edges = graph.setdefault(module, {})
        for line, imported, names in _imports(tree, path):
            for name in [f"{imported}.{n}" for n in names] or [imported]:
                while name and name not in trees:
                    name = name.rpartition(".")[0]
                where = (str(path.relative_to(PACKAGE.parent)), line)
                if name and name != module and where not in edges.setdefault(name, []):
                    edges[name].append(where)
    return graph


def _cycles(graph: dict) -> list[set]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle():
    graph = _import_graph()
    wrong = []
    for component in _cycles(graph):
        edges = [f"{a} -> {b} ({', '.join(f'{f}:{line}' for f, line in graph[a][b])})"
                 for a in sorted(component) for b in sorted(graph[a]) if b in component]
        wrong.append(f"cycle {sorted(component)}: " + "; ".join(edges))
    assert not wrong, "\n".join(wrong)


def _layer_of(module: str) -> int:
    parts = module.split(".")
    part = parts[1] if len(parts) > 1 else "__init__"
    for i, layer in enumerate(LAYERS):
        if part in layer:
            return i
    raise AssertionError(f"{module}: not in test_layout.LAYERS — give it a layer here and in docs/architecture.md")


def test_imports_follow_the_layer_order():
    wrong = []
    for module, edges in _import_graph().items():
        mine = _layer_of(module)
        for target, where in edges.items():
            if _layer_of(target) > mine:
                wrong += [(f, line, f"imports {target}: layer {'/'.join(LAYERS[_layer_of(target)])} is above "
                           f"{'/'.join(LAYERS[mine])}") for f, line in where]
    assert not wrong, "\n".join(f"{f}:{line} {what}" for f, line, what in sorted(wrong))


def _room(module: str) -> str:
    part = module.split(".")[2]
    return "spine" if part in SPINE else part


def _room_of(module: str) -> int:
    room = _room(module)
    for i, row in enumerate(ROOMS):
        if room in row:
            return i
    raise AssertionError(f"{module}: not in a room of test_layout.ROOMS — give it one (and docs/architecture.md)")


def test_the_rooms_of_fixes_import_one_way():
    wrong = []
    for module, edges in _import_graph().items():
        if not module.startswith("accel_fp8_fix.fixes."):
            continue
        mine, room = _room_of(module), _room(module)
        for target, where in edges.items():
            if not target.startswith("accel_fp8_fix.fixes.") or _room(target) == room:
                continue
            if _room_of(target) >= mine:
                wrong += [(f, line, f"imports {target}: room {_room(target)} is not below {room}")
                          for f, line in where]
    assert not wrong, "\n".join(f"{f}:{line} {what}" for f, line, what in sorted(wrong))


def test_every_room_of_fixes_exists_and_is_written_down():
    import re

    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    for room in [room for row in ROOMS for room in row if room != "spine"] + [f"{m}.py" for m in SPINE]:
        path = PACKAGE / "fixes" / room
        assert path.is_dir() or path.is_file(), f"test_layout names fixes/{room}: not there"
        assert re.search(rf"^    {re.escape(room)}/?\s", text, re.M), f"docs/architecture.md's map lacks fixes/{room}"


def test_every_layer_of_docs_architecture_exists_and_is_written_down():
    present = {_module_name(path).split(".")[1] if "." in _module_name(path) else "__init__"
               for path, _tree in _modules()}
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    for layer in LAYERS:
        for part in layer:
            assert part in present, f"LAYERS names {part}, which accel_fp8_fix/ does not have"
            assert f"`{part}`" in text.partition("## Layers")[2], f"docs/architecture.md 'Layers' does not name {part}"


def _direct_collectives(tree: ast.Module, path: Path) -> list[str]:
    """``file:line name`` of every torch.distributed collective called (or imported by name) in ``tree``."""
    aliases = {"dist"}  # the house name for torch.distributed, however it was bound
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update(a.asname for a in node.names if a.name in TORCH_DISTRIBUTED and a.asname)
        elif isinstance(node, ast.ImportFrom) and node.module in ("torch", *TORCH_DISTRIBUTED):
            for alias in node.names:
                if f"{node.module}.{alias.name}" in TORCH_DISTRIBUTED:
                    aliases.add(alias.asname or alias.name)
                elif node.module != "torch" and alias.name in COLLECTIVE_CALLS:
                    out.append(f"{path}:{node.lineno} imports {node.module}.{alias.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in COLLECTIVE_CALLS:
            receiver = ast.unparse(node.func.value)
            if receiver in aliases or receiver in TORCH_DISTRIBUTED:
                out.append(f"{path}:{node.lineno} calls {receiver}.{node.func.attr}")
    return out


def test_collectives_go_through_the_family():
    wrong = []
    for path, tree in _modules():
        relative = path.relative_to(PACKAGE.parent)
        if relative.parts[1] not in OUTSIDE_THE_COLLECTIVE_RULE:
            wrong += _direct_collectives(tree, relative)
    assert not wrong, "use accel_fp8_fix.distributed.collectives (group named, DTensor refused):\n" + "\n".join(wrong)


def test_the_collective_rule_sees_direct_calls():
    source = ("import torch.distributed as d\nfrom torch.distributed import all_gather\nimport torch\n"
              "def f(t, g):\n    d.all_reduce(t, group=g)\n    torch.distributed.broadcast(t, 0)\n"
              "    collectives.all_reduce(t, group=g)\n")
    found = _direct_collectives(ast.parse(source), Path("x.py"))
    assert found == ["x.py:2 imports torch.distributed.all_gather", "x.py:5 calls d.all_reduce",
                     "x.py:6 calls torch.distributed.broadcast"], found


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


# Transformer Engine's FP8 state layout and its tensors' private fields: reached only through internals/
# (transformer_engine/'s accessors). The rehearsal is TE's stand-in and may use them; testing/ does not need to.
# get_extra_state / set_extra_state / _extra_state are torch's nn.Module protocol, not TE's: not on the list.
TE_INTERNAL_ATTRS = frozenset({
    "fp8_meta", "init_fp8_metadata", "fp8_meta_tensors_initialized", "fp8_checkpoint", "quantizers",
    "make_quantizers", "scaling_fwd", "scaling_bwd", "amax_history", "_rowwise_data", "_columnwise_data",
    "_scale_inv", "_rowwise_scale_inv", "_columnwise_scale_inv", "_fp8_dtype", "_quantizer",
})
INSIDE_THE_TE_FENCE = ("internals", "rehearsal")


def _te_attribute_uses(tree: ast.Module, path) -> list[str]:
    """``file:line name`` of every deny-listed TE attribute: ``x.name`` and ``getattr`` / ``hasattr`` /
    ``setattr`` / ``delattr`` with the name as a string constant."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in TE_INTERNAL_ATTRS:
            out.append(f"{path}:{node.lineno} .{node.attr}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and node.args[1].value in TE_INTERNAL_ATTRS):
            out.append(f"{path}:{node.lineno} {node.func.id}(..., {node.args[1].value!r})")
    return out


def test_transformer_engine_attributes_only_in_internals():
    wrong = []
    for path, tree in _modules():
        relative = path.relative_to(PACKAGE.parent)
        if relative.parts[1] not in INSIDE_THE_TE_FENCE:
            wrong += _te_attribute_uses(tree, relative)
    assert not wrong, ("reach TE's FP8 state through accel_fp8_fix/internals/transformer_engine/:\n"
                       + "\n".join(wrong))


def test_the_te_fence_sees_attributes_and_getattr():
    source = ("def f(m, t):\n    m.fp8_meta['fp8_checkpoint'] = True\n    hasattr(m, 'init_fp8_metadata')\n"
              "    getattr(t, '_rowwise_data', None)\n    m.weight_quantizers\n    getattr(m, name)\n")
    found = _te_attribute_uses(ast.parse(source), Path("x.py"))
    assert sorted(found) == ["x.py:2 .fp8_meta", "x.py:3 hasattr(..., 'init_fp8_metadata')",
                             "x.py:4 getattr(..., '_rowwise_data')"], found


# TE's checkpoint schema and scale formula (issue 46 item 1): internals/transformer_engine/checkpoint.py knows the
# ``_extra_state`` payload's keys and TE's recipe module (the only classes a payload may name), scaling.py TE's
# ``compute_scale_from_amax`` and each recipe's settings of it. Outside the fence no string may name them, and no
# expression may compute a scale from an FP8 type's max (``fp8_max / amax``), clear a scale's mantissa (power-of-2
# scales: ``0xFF800000``) or divide by ``2**margin`` (``ldexp``). Importing TE's public recipe module is allowed.
TE_CHECKPOINT_LITERALS = frozenset({
    "transformer_engine.common.recipe", "scale_fwd", "scale_bwd", "amax_history_fwd", "amax_history_bwd",
    "scale_inv_fwd", "scale_inv_bwd", "extra_fp8_variables",
})
TE_SCALE_NAMES = ("fp8_max", "max_fp8")
TE_SCALE_MASKS = (0xFF800000, 0xFF800000 - (1 << 32))


def _te_knowledge_uses(tree: ast.Module, path) -> list[str]:
    """``file:line what`` of TE's checkpoint schema named in a string and TE's scale formula computed."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in TE_CHECKPOINT_LITERALS:
            out.append(f"{path}:{node.lineno} {node.value!r}")
        elif isinstance(node, ast.Constant) and type(node.value) is int and node.value in TE_SCALE_MASKS:
            out.append(f"{path}:{node.lineno} {hex(node.value)}")
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            names = {n.id for n in ast.walk(node.left) if isinstance(n, ast.Name)}
            names |= {n.attr for n in ast.walk(node.left) if isinstance(n, ast.Attribute)}
            if any(scale in name for name in names for scale in TE_SCALE_NAMES):
                out.append(f"{path}:{node.lineno} a scale from an FP8 max")
        elif isinstance(node, (ast.Attribute, ast.Name)) and getattr(node, "attr", getattr(node, "id", "")) == "ldexp":
            out.append(f"{path}:{node.lineno} ldexp")
    return out


def test_te_checkpoint_schema_and_scale_formula_only_in_internals():
    wrong = []
    for path, tree in _modules():
        relative = path.relative_to(PACKAGE.parent)
        if relative.parts[1] not in INSIDE_THE_TE_FENCE:
            wrong += _te_knowledge_uses(tree, relative)
    assert not wrong, ("TE's extra-state schema and scale formula live in accel_fp8_fix/internals/transformer_engine/ "
                       "(checkpoint.py, scaling.py):\n" + "\n".join(wrong))


def test_the_te_fence_sees_the_schema_and_the_formula():
    source = ("import transformer_engine.common.recipe as r\n"
              "def f(p, amax, s, torch):\n    p['scale_fwd']\n    m = 'transformer_engine.common.recipe'\n"
              "    x = torch.full_like(amax, p.fp8_max) / amax\n    y = fp8_max / amax\n    z = s & 0xFF800000\n"
              "    torch.ldexp(x, -2)\n    w = amax / 2\n")
    found = _te_knowledge_uses(ast.parse(source), Path("x.py"))
    assert sorted(found) == ["x.py:3 'scale_fwd'", "x.py:4 'transformer_engine.common.recipe'",
                             "x.py:5 a scale from an FP8 max", "x.py:6 a scale from an FP8 max", "x.py:7 0xff800000",
                             "x.py:8 ldexp"], found


# -- the package owns its state (issue 46 item 2) -----------------------------------------------------------------
# What passes between the stages of a run lives in the package's records (fixes/convert/run_state.py), looked up by the
# package — never as attributes on accelerate's, torch's or TE's objects. Attributes that only mark a step done (so
# that it is idempotent) may stay: MARKERS. NOT_YET_MOVED: state still carried on foreign objects (empty since the
# module records of fixes/convert/run_state.py; kept so that a name moved out for a while can be listed).
MARKERS = frozenset({
    "_accel_fp8_fix_autocast",  # a forward wrapped under TE autocast (fixes/convert/fp8_autocast.py)
    "_accel_fp8_fix_observed",  # TE's amax reduction observed (rehearsal)
    "_accel_fp8_fix_keeps_fp8_state",  # a TE module's get_extra_state wrapped (fixes/checkpoint/checkpoint.py)
    "_accel_fp8_fix_forward_notes",  # a model's forward error notes installed (diagnostics/notes.py)
    "_self_accel_fp8_fix_audit",  # a collective wrapped by the audit (diagnostics/collective_order.py)
    "_accel_fp8_fix_noted", "_accel_fp8_fix_diagnosed",  # an exception given its note (diagnostics/notes.py)
    # a state-dict key torch's distributed state_dict resolves to an attribute: set only inside save_state /
    # load_state, removed when they end (fixes/checkpoint/ep_checkpoint.py)
    "_accel_fp8_fix_ep_fp8",
})
NOT_YET_MOVED = frozenset()


def test_no_package_state_on_foreign_objects_but_markers():
    import re

    found = set()
    for path in PACKAGE.rglob("*.py"):
        found |= set(re.findall(r"_(?:self_)?accel_fp8_fix_[a-z0-9_]*[a-z0-9]", path.read_text()))
    found = {name if name.startswith("_self_") else "_" + name.lstrip("_") for name in found}
    new = found - MARKERS - NOT_YET_MOVED
    assert not new, f"state on foreign objects: keep it in the package's records (fixes/convert/run_state.py): " \
                    f"{sorted(new)}"
    moved = NOT_YET_MOVED - found
    assert not moved, f"moved into the package's records: take them off NOT_YET_MOVED: {sorted(moved)}"


def test_inside_a_patched_prepare_is_a_context_variable():
    """The flag the inner calls of a patched prepare read is a ContextVar of the package, set for that accelerator
    only: another accelerator, or the same one outside the block, is not inside."""
    from accel_fp8_fix.fixes.convert import run_state

    class Accelerator:
        pass

    first, second = Accelerator(), Accelerator()
    assert not run_state.inside_prepare(first)
    with run_state.preparing(first):
        assert run_state.inside_prepare(first) and not run_state.inside_prepare(second)
        with run_state.preparing(second):
            assert run_state.inside_prepare(second) and not run_state.inside_prepare(first)
        assert run_state.inside_prepare(first)
    assert not run_state.inside_prepare(first) and not vars(first)  # nothing set on the accelerator
    run_state.record(first).agreed = True
    assert run_state.record(first).agreed and not run_state.record(second).agreed and not vars(first)


def test_no_module_of_the_package_is_reached_through_sys_modules():
    """A module of the package is imported (or registers itself: accel_fp8_fix/caches.py), never fetched from
    ``sys.modules`` — a reach-in that hides an arrow from the layer check."""
    import re

    found = [f"{path.relative_to(PACKAGE.parent)}:{i}" for path in PACKAGE.rglob("*.py")
             for i, line in enumerate(path.read_text().splitlines(), 1)
             if re.search(r"""sys\.modules(?:\.get\(|\[)\s*["']accel_fp8_fix""", line)]
    assert not found, found


def test_every_module_level_cache_is_emptied_by_the_one_reset():
    """The caches a rank pool empties between runs, registered by their modules: reset() empties each."""
    import accel_fp8_fix.distributed.collectives as collectives
    from accel_fp8_fix import _log, caches, settings
    from accel_fp8_fix.distributed import agreement
    from accel_fp8_fix.fixes.start import clean_exit

    names = caches.registered()
    for module in ("_log", "settings", "distributed.collectives", "distributed.agreement", "fixes.start.clean_exit"):
        assert any(n.startswith(module + ":") for n in names), (module, names)
    _log._said.add("x")
    settings._warned.add("y")
    next(agreement._round)
    collectives._cache_world[0] = "a world"
    caches.reset()
    assert not _log._said and not settings._warned and next(agreement._round) == 0
    assert collectives._cache_world[0] is None and not clean_exit._registered


# -- the runtime wheel (issue 46 item 3) ----------------------------------------------------------------------------
# This project's own suite machinery: the rank pools and their isolation stay in the source tree (editable installs)
# and out of the runtime wheel (pyproject's exclude; tests/network/test_packaging.py builds the wheel and looks).
SUITE_ONLY = ("testing/pool.py", "testing/_pool_worker.py", "testing/isolation.py")


def _wheel_excludes() -> list[str]:
    import tomllib

    pyproject = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())
    return pyproject["tool"]["hatch"]["build"]["targets"]["wheel"]["exclude"]


def test_the_suite_machinery_is_left_out_of_the_wheel_and_the_audit_kept():
    excluded = _wheel_excludes()
    for path in SUITE_ONLY:
        assert (PACKAGE / path).is_file(), f"{path}: gone from the source tree — update SUITE_ONLY"
        assert f"accel_fp8_fix/{path}" in excluded, f"pyproject.toml's wheel exclude lacks accel_fp8_fix/{path}"
    kept = [p for p in excluded if not p.startswith("accel_fp8_fix/rehearsal")]
    assert sorted(kept) == sorted(f"accel_fp8_fix/{p}" for p in SUITE_ONLY), kept  # the user's diagnostics stay in


def test_nothing_the_wheel_keeps_imports_the_suite_machinery():
    left_out = {_module_name(PACKAGE / path) for path in SUITE_ONLY}
    wrong = []
    for path, tree in _modules():
        relative = path.relative_to(PACKAGE).as_posix()
        if relative in SUITE_ONLY or relative.startswith("rehearsal/"):
            continue
        wrong += [f"accel_fp8_fix/{relative}:{line} imports {name}" for line, module, names in _imports(tree, path)
                  for name in (module, *(f"{module}.{n}" for n in names)) if name in left_out]
    assert not wrong, "a module of the runtime wheel imports what the wheel leaves out:\n" + "\n".join(wrong)


# -- the benchmarks import the shared harness by name (issue 46 item 3) ---------------------------------------------
# What the suite and the benchmarks share lives in the package (accel_fp8_fix/testing/training.py): a benchmark imports
# it by name, never edits sys.path or reaches into the suite's tests/ (``support``). NOT_YET_BY_NAME: benchmarks that
# still launch whole scenario modules of tests/support/ (large and test-only: the FP8 all-gather's); the list
# only shrinks (one that stops reaching in must leave it).
BENCHMARKS = PACKAGE.parent / "benchmarks"
NOT_YET_BY_NAME = frozenset({"fp8_all_gather.py"})


def _reaches_into_the_suite(tree: ast.Module, path) -> list[str]:
    """``file:line what`` of every ``sys.path`` edit and every import of ``tests`` / ``support`` in ``tree``."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "path" and ast.unparse(node.value) == "sys":
            out.append(f"{path}:{node.lineno} sys.path")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            out += [f"{path}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in ("tests", "support")]
    return out


def test_benchmarks_import_the_harness_by_name():
    wrong, still = [], set()
    for path in sorted(BENCHMARKS.glob("*.py")):
        found = _reaches_into_the_suite(ast.parse(path.read_text(), filename=str(path)), path.name)
        if found and path.name in NOT_YET_BY_NAME:
            still.add(path.name)
        elif found:
            wrong += found
    assert not wrong, ("import what a benchmark shares with the suite from accel_fp8_fix.testing (training.py), by "
                       "name:\n" + "\n".join(wrong))
    moved = NOT_YET_BY_NAME - still
    assert not moved, f"no longer reaching into tests/: take them off NOT_YET_BY_NAME: {sorted(moved)}"


def test_the_benchmark_rule_sees_path_edits_and_suite_imports():
    source = ("import sys, os\nsys.path.insert(0, 'tests')\nfrom support import scenarios\nimport tests.support.x\n"
              "from accel_fp8_fix.testing import training\nos.path.join('a')\n")
    found = _reaches_into_the_suite(ast.parse(source), "x.py")
    assert sorted(found) == ["x.py:2 sys.path", "x.py:3 imports support", "x.py:4 imports tests.support.x"], found
