"""Extract Transformer Engine's Python contract from its source with ``ast`` -- no import of TE.

The source comes from the pure-Python ``transformer-engine`` wheel (``py3-none-any``), read straight
out of the zip (or from an in-memory ``{path: source}`` mapping, which is what the unit tests use).

What is extracted (see :func:`extract_contract`):

* ``modules``: for ``Linear``, ``LayerNorm``, ``RMSNorm``, ``LayerNormLinear`` -- found by following
  the exports of ``transformer_engine/pytorch/__init__.py`` through ``from x import y`` chains,
  star imports and ``a = b`` re-bindings -- the ``__init__`` parameters (name, kind, default when it
  is a literal, the default's source otherwise), the names accepted through ``**kwargs`` when they
  are forwarded to a base class's ``__init__``, and the attributes set on ``self`` in ``__init__``
  (``self.x = ...``, ``self.fast_setattr("x", ...)``, ``setattr(self, "x", ...)``), including base
  classes' ``__init__`` and methods called from ``__init__`` as ``self.method(...)``.
* ``functions``: signatures of ``fp8_autocast`` and ``autocast`` (a class in TE 2.x: its ``__init__``).
* ``recipes``: dataclass fields (in order, with defaults) of ``DelayedScaling``,
  ``Float8CurrentScaling``, ``MXFP8BlockScaling`` -- ``None`` for a recipe the version lacks -- and
  the members of ``Format`` (with ``max_fwd``/``max_bwd`` where they are literal).
* ``fp8_meta``: the keys of the dict created as ``self.fp8_meta`` in ``__init__`` (``init_keys``)
  and every key written into an ``fp8_meta`` dict (``written_keys``, each with its locations):
  ``self.fp8_meta[k] = ...``, through aliases (``meta = self.fp8_meta``; function parameters named
  ``fp8_meta``), ``.update({...})`` and ``.setdefault(k, ...)``. A key given by a variable is resolved
  when the variable is bound to string constants, a conditional of them, a loop over a literal tuple,
  or a call to a method of the same class that returns string constants; otherwise it is recorded
  under ``dynamic``.

Run ``python tests/te_contract/extract.py [WHEEL_OR_VERSION ...]`` to print the contract as JSON
(a version such as ``2.20.2`` is fetched into the wheel cache first).
"""

from __future__ import annotations

import ast
import json
import os
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple

MODULE_CLASSES = ("Linear", "LayerNorm", "RMSNorm", "LayerNormLinear")
AUTOCAST_FUNCTIONS = ("fp8_autocast", "autocast")
RECIPE_CLASSES = ("DelayedScaling", "Float8CurrentScaling", "MXFP8BlockScaling")
PYTORCH_PKG = "transformer_engine.pytorch"
RECIPE_PKG = "transformer_engine.common.recipe"

# Files scanned for writes into an ``fp8_meta`` dict (module machinery and the global FP8 state
# manager; attention's private keys are left out on purpose). Directories end with '/'.
FP8_META_SCAN = (
    "transformer_engine/pytorch/module/",
    "transformer_engine/pytorch/quantization.py",
    "transformer_engine/pytorch/fp8.py",
    "transformer_engine/pytorch/graph.py",
    "transformer_engine/pytorch/distributed.py",
)

_SETATTR_METHODS = ("fast_setattr", "module_setattr", "__setattr__")


# --------------------------------------------------------------------------------------------
# Source access
# --------------------------------------------------------------------------------------------


class SourceTree:
    """Python files of a distribution, by path inside it (``transformer_engine/pytorch/fp8.py``)."""

    def __init__(self, files: Mapping[str, str], origin: str = "<memory>", version: str = ""):
        self._files = dict(files)
        self.origin = origin
        self.version = version
        self._ast: Dict[str, ast.Module] = {}

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_archive(cls, path: os.PathLike | str) -> "SourceTree":
        """Read every ``.py`` file (and the version) out of a wheel or an sdist, without extracting."""
        path = Path(path)
        files: Dict[str, str] = {}
        version = ""
        if path.suffix in (".whl", ".zip"):
            with zipfile.ZipFile(path) as zf:
                for name in zf.namelist():
                    if name.endswith(".py"):
                        files[name] = zf.read(name).decode("utf-8", "replace")
                    elif name.endswith(".dist-info/METADATA"):
                        version = _metadata_version(zf.read(name).decode("utf-8", "replace"))
        elif path.name.endswith((".tar.gz", ".tgz")):
            with tarfile.open(path) as tf:
                for member in tf.getmembers():
                    if not member.isfile():
                        continue
                    # sdists put everything under "<name>-<version>/"
                    inner = member.name.split("/", 1)[1] if "/" in member.name else member.name
                    if inner.endswith(".py"):
                        data = tf.extractfile(member).read()  # type: ignore[union-attr]
                        files[inner] = data.decode("utf-8", "replace")
                    elif inner == "PKG-INFO":
                        data = tf.extractfile(member).read()  # type: ignore[union-attr]
                        version = _metadata_version(data.decode("utf-8", "replace"))
        else:
            raise ValueError(f"not a wheel or sdist: {path}")
        return cls(files, origin=str(path), version=version)

    # -- access -------------------------------------------------------------------------------
    def has(self, path: str) -> bool:
        return path in self._files

    def paths(self) -> List[str]:
        return sorted(self._files)

    def parse(self, path: str) -> Optional[ast.Module]:
        if path not in self._files:
            return None
        if path not in self._ast:
            self._ast[path] = ast.parse(self._files[path], filename=path)
        return self._ast[path]

    def module_path(self, modname: str) -> Optional[str]:
        base = modname.replace(".", "/")
        for cand in (base + ".py", base + "/__init__.py"):
            if cand in self._files:
                return cand
        return None

    @staticmethod
    def module_name(path: str) -> str:
        mod = path[:-3] if path.endswith(".py") else path
        if mod.endswith("/__init__"):
            mod = mod[: -len("/__init__")]
        return mod.replace("/", ".")


def _metadata_version(text: str) -> str:
    for line in text.splitlines():
        if line.startswith("Version:"):
            return line.split(":", 1)[1].strip()
    return ""


# --------------------------------------------------------------------------------------------
# Symbol resolution
# --------------------------------------------------------------------------------------------


@dataclass
class Symbol:
    """A class or function definition found in the tree."""

    node: Any  # ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
    module: str  # dotted module name
    path: str  # file path inside the distribution

    @property
    def name(self) -> str:
        return self.node.name

    @property
    def where(self) -> str:
        return f"{self.path}:{self.node.lineno}"


def _toplevel_statements(body: Iterable[ast.stmt]) -> Iterator[ast.stmt]:
    """Module-level statements, descending into if/try/with blocks (not into defs)."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, (ast.If, ast.While, ast.For)):
            yield from _toplevel_statements(stmt.body)
            yield from _toplevel_statements(stmt.orelse)
        elif isinstance(stmt, ast.Try) or type(stmt).__name__ == "TryStar":
            yield from _toplevel_statements(stmt.body)
            for handler in stmt.handlers:
                yield from _toplevel_statements(handler.body)
            yield from _toplevel_statements(stmt.orelse)
            yield from _toplevel_statements(stmt.finalbody)
        elif isinstance(stmt, (ast.With, ast.AsyncWith)):
            yield from _toplevel_statements(stmt.body)


def _absolute_module(current_module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = current_module if is_package else current_module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    if node.module:
        return f"{package}.{node.module}" if package else node.module
    return package


def resolve(tree: SourceTree, module: str, name: str, _seen: Optional[set] = None) -> Optional[Symbol]:
    """Find the class/function that ``module.name`` denotes, following imports and re-bindings."""
    seen = _seen if _seen is not None else set()
    if (module, name) in seen:
        return None
    seen.add((module, name))
    path = tree.module_path(module)
    if path is None:
        return None
    mod_ast = tree.parse(path)
    is_package = path.endswith("/__init__.py")
    found: Optional[Symbol] = None
    star_modules: List[str] = []
    for stmt in _toplevel_statements(mod_ast.body):  # later bindings win
        if isinstance(stmt, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == name:
            found = Symbol(stmt, module, path)
        elif isinstance(stmt, ast.ImportFrom):
            target = _absolute_module(module, is_package, stmt)
            for alias in stmt.names:
                if alias.name == "*":
                    star_modules.append(target)
                elif (alias.asname or alias.name) == name:
                    sym = resolve(tree, target, alias.name, seen)
                    if sym is None:  # "from pkg import submodule"-style or outside the tree
                        continue
                    found = sym
        elif isinstance(stmt, ast.Assign) and isinstance(stmt.value, (ast.Name, ast.Attribute)):
            if any(isinstance(t, ast.Name) and t.id == name for t in stmt.targets):
                sym = _resolve_expr(tree, module, is_package, stmt.value, seen)
                if sym is not None:
                    found = sym
    if found is None:
        for target in star_modules:
            found = resolve(tree, target, name, seen)
            if found is not None:
                break
    return found


def _resolve_expr(tree: SourceTree, module: str, is_package: bool, expr: ast.expr, seen: set) -> Optional[Symbol]:
    if isinstance(expr, ast.Name):
        return resolve(tree, module, expr.id, seen)
    if isinstance(expr, ast.Attribute):
        dotted = _dotted(expr)
        if dotted:
            owner, _, attr = dotted.rpartition(".")
            # a module imported into this one ("import x.y as z"; "from . import z") or absolute
            for cand in (owner, f"{module}.{owner}" if is_package else f"{module.rpartition('.')[0]}.{owner}"):
                if tree.module_path(cand):
                    return resolve(tree, cand, attr, seen)
    return None


def _dotted(expr: ast.expr) -> Optional[str]:
    parts = []
    while isinstance(expr, ast.Attribute):
        parts.append(expr.attr)
        expr = expr.value
    if isinstance(expr, ast.Name):
        parts.append(expr.id)
        return ".".join(reversed(parts))
    return None


def class_bases(tree: SourceTree, cls: Symbol) -> List[Symbol]:
    """Base classes of ``cls`` that are defined inside the tree (others, e.g. torch's, are dropped)."""
    path = cls.path
    is_package = path.endswith("/__init__.py")
    out = []
    for base in cls.node.bases:
        sym = _resolve_expr(tree, cls.module, is_package, base, set())
        if sym is not None and isinstance(sym.node, ast.ClassDef):
            out.append(sym)
    return out


def mro(tree: SourceTree, cls: Symbol) -> List[Symbol]:
    """Depth-first, left-to-right linearisation of the in-tree bases (good enough for TE)."""
    out: List[Symbol] = []
    stack = [cls]
    while stack:
        sym = stack.pop(0)
        if any(s.node is sym.node for s in out):
            continue
        out.append(sym)
        stack[0:0] = class_bases(tree, sym)
    return out


def find_method(tree: SourceTree, cls: Symbol, name: str) -> Optional[Symbol]:
    for sym in mro(tree, cls):
        for stmt in sym.node.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == name:
                return Symbol(stmt, sym.module, sym.path)
    return None


# --------------------------------------------------------------------------------------------
# Signatures
# --------------------------------------------------------------------------------------------

_NO_VALUE = object()


def _literal(node: Optional[ast.expr]) -> Tuple[bool, Any]:
    """(is_literal, value) -- JSON-representable literals only."""
    if node is None:
        return False, None
    try:
        value = ast.literal_eval(node)
    except Exception:
        return False, None
    try:
        json.dumps(value)
    except TypeError:
        return False, None
    return True, value


def _param(name: str, kind: str, default: Optional[ast.expr], annotation: Optional[ast.expr]) -> Dict[str, Any]:
    out: Dict[str, Any] = {"name": name, "kind": kind, "has_default": default is not None}
    if default is not None:
        is_lit, value = _literal(default)
        out["literal"] = is_lit
        out["default"] = value if is_lit else None
        out["default_src"] = ast.unparse(default)
    if annotation is not None:
        out["annotation"] = ast.unparse(annotation)
    return out


def function_params(fn: ast.FunctionDef, drop_first: bool = False) -> List[Dict[str, Any]]:
    """Parameters of a ``def`` in ``inspect.Parameter.kind`` terms."""
    a = fn.args
    positional = list(a.posonlyargs) + list(a.args)
    defaults: List[Optional[ast.expr]] = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    params = []
    for i, arg in enumerate(positional):
        kind = "POSITIONAL_ONLY" if i < len(a.posonlyargs) else "POSITIONAL_OR_KEYWORD"
        params.append(_param(arg.arg, kind, defaults[i], arg.annotation))
    if a.vararg is not None:
        params.append(_param(a.vararg.arg, "VAR_POSITIONAL", None, a.vararg.annotation))
    for arg, default in zip(a.kwonlyargs, a.kw_defaults):
        params.append(_param(arg.arg, "KEYWORD_ONLY", default, arg.annotation))
    if a.kwarg is not None:
        params.append(_param(a.kwarg.arg, "VAR_KEYWORD", None, a.kwarg.annotation))
    if drop_first and params and params[0]["kind"] in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD"):
        params = params[1:]
    return params


def callable_signature(tree: SourceTree, sym: Symbol) -> Dict[str, Any]:
    """Signature of a function, or of a class's constructor (its in-tree ``__init__``)."""
    if isinstance(sym.node, ast.ClassDef):
        init = find_method(tree, sym, "__init__")
        if init is None:
            return {"kind": "class", "defined_at": sym.where, "init_at": None, "params": []}
        params = function_params(init.node, drop_first=True)
        return {"kind": "class", "defined_at": sym.where, "init_at": init.where, "params": params,
                "init_owner": _owner_name(tree, sym, init)}
    return {"kind": "function", "defined_at": sym.where, "params": function_params(sym.node)}


def _owner_name(tree: SourceTree, cls: Symbol, method: Symbol) -> str:
    for sym in mro(tree, cls):
        if method.node in sym.node.body:
            return sym.name
    return cls.name


def kwargs_forwarded(tree: SourceTree, cls: Symbol) -> List[str]:
    """Names a ``**kwargs`` constructor passes on to the base's ``__init__`` (``super().__init__(**kw)``)."""
    init = find_method(tree, cls, "__init__")
    if init is None or init.node.args.kwarg is None:
        return []
    kwname = init.node.args.kwarg.arg
    forwards = False
    for node in ast.walk(init.node):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "__init__"
                and any(k.arg is None and isinstance(k.value, ast.Name) and k.value.id == kwname
                        for k in node.keywords)):
            forwards = True
    if not forwards:
        return []
    own = {p["name"] for p in function_params(init.node, drop_first=True)}
    owner = next(s for s in mro(tree, cls) if init.node in s.node.body)
    out: List[str] = []
    for base in class_bases(tree, owner):
        base_init = find_method(tree, base, "__init__")
        if base_init is None:
            continue
        for p in function_params(base_init.node, drop_first=True):
            if p["kind"] in ("POSITIONAL_OR_KEYWORD", "KEYWORD_ONLY") and p["name"] not in own and p["name"] not in out:
                out.append(p["name"])
        out.extend(n for n in kwargs_forwarded(tree, base) if n not in own and n not in out)
        break  # super() is the first in-tree base
    return out


# --------------------------------------------------------------------------------------------
# Attributes set in __init__
# --------------------------------------------------------------------------------------------


def _first_arg(fn: ast.FunctionDef) -> Optional[str]:
    positional = list(fn.args.posonlyargs) + list(fn.args.args)
    return positional[0].arg if positional else None


def _self_attr_sets(fn: ast.FunctionDef) -> List[Tuple[str, int]]:
    """(attr, lineno) for every attribute the function sets on its first argument."""
    me = _first_arg(fn)
    if me is None:
        return []
    out: List[Tuple[str, int]] = []

    def targets_of(t: ast.expr) -> Iterator[ast.expr]:
        if isinstance(t, (ast.Tuple, ast.List)):
            for elt in t.elts:
                yield from targets_of(elt)
        elif isinstance(t, ast.Starred):
            yield from targets_of(t.value)
        else:
            yield t

    for node in ast.walk(fn):
        tgts: List[ast.expr] = []
        if isinstance(node, ast.Assign):
            tgts = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            tgts = [node.target]
        for t in tgts:
            for leaf in targets_of(t):
                if isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name) and leaf.value.id == me:
                    out.append((leaf.attr, leaf.lineno))
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            first = node.args[0]
            # self.fast_setattr("x", v) / self.module_setattr("x", v)
            if (isinstance(f, ast.Attribute) and f.attr in _SETATTR_METHODS and isinstance(f.value, ast.Name)
                    and f.value.id == me and isinstance(first, ast.Constant) and isinstance(first.value, str)):
                out.append((first.value, node.lineno))
            # setattr(self, "x", v) / object.__setattr__(self, "x", v)
            is_setattr = (isinstance(f, ast.Name) and f.id == "setattr") or (
                isinstance(f, ast.Attribute) and f.attr == "__setattr__" and not (
                    isinstance(f.value, ast.Name) and f.value.id == me))
            if (is_setattr and len(node.args) >= 2 and isinstance(first, ast.Name) and first.id == me
                    and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
                out.append((node.args[1].value, node.lineno))
    return out


def _self_method_calls(fn: ast.FunctionDef) -> List[str]:
    me = _first_arg(fn)
    if me is None:
        return []
    out = []
    for node in ast.walk(fn):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == me
                and node.func.attr not in _SETATTR_METHODS and node.func.attr not in out):
            out.append(node.func.attr)
    return out


def init_attributes(tree: SourceTree, cls: Symbol, call_depth: int = 2) -> Dict[str, str]:
    """``{attr: where}`` for attributes set on ``self`` by the constructor chain of ``cls``.

    Every in-tree class's ``__init__`` along the MRO counts, plus methods the constructors call
    as ``self.method(...)`` (to ``call_depth`` levels: ``set_tensor_parallel_group`` sets
    ``tp_group``).
    """
    attrs: Dict[str, str] = {}
    visited: set = set()

    def visit(fn_sym: Symbol, label: str, depth: int) -> None:
        if id(fn_sym.node) in visited:
            return
        visited.add(id(fn_sym.node))
        for attr, line in _self_attr_sets(fn_sym.node):
            attrs.setdefault(attr, f"{label} ({fn_sym.path}:{line})")
        if depth <= 0:
            return
        for meth in _self_method_calls(fn_sym.node):
            target = find_method(tree, cls, meth)
            if target is not None and meth != "__init__":
                visit(target, f"{_owner_name(tree, cls, target)}.{meth}", depth - 1)

    for sym in mro(tree, cls):
        for stmt in sym.node.body:
            if isinstance(stmt, ast.FunctionDef) and stmt.name == "__init__":
                visit(Symbol(stmt, sym.module, sym.path), f"{sym.name}.__init__", call_depth)
    return dict(sorted(attrs.items()))


# --------------------------------------------------------------------------------------------
# fp8_meta keys
# --------------------------------------------------------------------------------------------


def _is_fp8_meta_expr(expr: ast.expr, aliases: set) -> bool:
    if isinstance(expr, ast.Attribute) and expr.attr == "fp8_meta":
        return True
    return isinstance(expr, ast.Name) and expr.id in aliases


def _functions_with_class(mod_ast: ast.Module) -> Iterator[Tuple[Optional[ast.ClassDef], ast.FunctionDef]]:
    def walk(body, cls):
        for stmt in body:
            if isinstance(stmt, ast.ClassDef):
                yield from walk(stmt.body, stmt)
            elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield cls, stmt
                yield from walk(stmt.body, cls)  # nested defs
            else:
                for field_name in ("body", "orelse", "finalbody", "handlers"):
                    sub = getattr(stmt, field_name, None)
                    if isinstance(sub, list):
                        yield from walk(sub, cls)
    yield from walk(mod_ast.body, None)


def _walk_own(fn: ast.AST) -> Iterator[ast.AST]:
    """``ast.walk`` over a function's own body, not descending into nested defs/classes/lambdas."""
    todo = list(ast.iter_child_nodes(fn))
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(node))


class _KeyResolver:
    """Resolves a subscript key expression to the string constants it can take."""

    def __init__(self, fn: ast.FunctionDef, cls: Optional[ast.ClassDef]):
        self.fn = fn
        self.cls = cls
        self.bindings: Dict[str, List[ast.expr]] = {}
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        self.bindings.setdefault(t.id, []).append(node.value)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
                self.bindings.setdefault(node.target.id, []).append(node.value)
            elif isinstance(node, (ast.For, ast.comprehension)) and isinstance(node.target, ast.Name):
                if isinstance(node.iter, (ast.Tuple, ast.List, ast.Set)):
                    self.bindings.setdefault(node.target.id, []).extend(node.iter.elts)
                else:
                    self.bindings.setdefault(node.target.id, []).append(node.iter)

    def values(self, expr: ast.expr, depth: int = 0) -> Optional[List[str]]:
        if depth > 4:
            return None
        if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
            return [expr.value]
        if isinstance(expr, ast.IfExp):
            a, b = self.values(expr.body, depth + 1), self.values(expr.orelse, depth + 1)
            return a + b if a is not None and b is not None else None
        if isinstance(expr, ast.Name) and expr.id in self.bindings:
            out: List[str] = []
            for value in self.bindings[expr.id]:
                vals = self.values(value, depth + 1)
                if vals is None:
                    return None
                out.extend(v for v in vals if v not in out)
            return out
        if (isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and self.cls is not None
                and isinstance(expr.func.value, ast.Name) and expr.func.value.id in ("self", "cls", self.cls.name)):
            for stmt in self.cls.body:
                if isinstance(stmt, ast.FunctionDef) and stmt.name == expr.func.attr:
                    sub = _KeyResolver(stmt, self.cls)
                    out = []
                    for ret in (n for n in ast.walk(stmt) if isinstance(n, ast.Return) and n.value is not None):
                        vals = sub.values(ret.value, depth + 1)
                        if vals is None:
                            return None
                        out.extend(v for v in vals if v not in out)
                    return out or None
        return None


def fp8_meta_writes(tree: SourceTree, paths: Iterable[str]) -> Tuple[Dict[str, List[str]], List[str]]:
    """({key: [locations]}, [dynamic writes]) for writes into ``fp8_meta`` dicts in ``paths``."""
    keys: Dict[str, List[str]] = {}
    dynamic: List[str] = []

    def record(key_expr: ast.expr, resolver: _KeyResolver, where: str) -> None:
        vals = resolver.values(key_expr)
        if vals is None:
            dynamic.append(f"{where}: [{ast.unparse(key_expr)}]")
            return
        for v in vals:
            keys.setdefault(v, [])
            if where not in keys[v]:
                keys[v].append(where)

    for path in paths:
        mod_ast = tree.parse(path)
        if mod_ast is None:
            continue
        for cls, fn in _functions_with_class(mod_ast):
            aliases = {a.arg for a in fn.args.args + fn.args.kwonlyargs if a.arg == "fp8_meta"}
            for node in _walk_own(fn):
                if isinstance(node, ast.Assign) and _is_fp8_meta_expr(node.value, set()):
                    aliases.update(t.id for t in node.targets if isinstance(t, ast.Name))
            resolver = _KeyResolver(fn, cls)
            label = f"{cls.name}.{fn.name}" if cls is not None else fn.name
            for node in _walk_own(fn):
                where = f"{path}:{getattr(node, 'lineno', fn.lineno)} ({label})"
                tgts: List[ast.expr] = []
                if isinstance(node, ast.Assign):
                    tgts = list(node.targets)
                elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                    tgts = [node.target]
                for t in tgts:
                    if isinstance(t, ast.Subscript) and _is_fp8_meta_expr(t.value, aliases):
                        record(t.slice, resolver, where)
                    # self.fp8_meta = {...literal...} outside __init__ counts as writes too
                    if _is_fp8_meta_expr(t, set()) and isinstance(node.value, ast.Dict):
                        for k in node.value.keys:
                            if k is not None:
                                record(k, resolver, where)
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and _is_fp8_meta_expr(node.func.value, aliases)):
                    if node.func.attr == "setdefault" and node.args:
                        record(node.args[0], resolver, where)
                    elif node.func.attr == "update":
                        for arg in node.args:
                            if isinstance(arg, ast.Dict):
                                for k in arg.keys:
                                    if k is not None:
                                        record(k, resolver, where)
                            else:
                                dynamic.append(f"{where}: update({ast.unparse(arg)})")
                        for kw in node.keywords:
                            if kw.arg is not None:
                                keys.setdefault(kw.arg, []).append(where)
    return dict(sorted(keys.items())), dynamic


def fp8_meta_init_keys(tree: SourceTree, cls: Symbol) -> Tuple[List[str], Optional[str]]:
    """Keys of ``self.fp8_meta`` right after construction, and the class whose ``__init__`` makes it."""
    for sym in reversed(mro(tree, cls)):  # base first: it creates the dict, subclasses add to it
        init = next((s for s in sym.node.body if isinstance(s, ast.FunctionDef) and s.name == "__init__"), None)
        if init is None:
            continue
        created = False
        keys: List[str] = []
        resolver = _KeyResolver(init, sym.node)
        for node in ast.walk(init):
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    if _is_fp8_meta_expr(t, set()) and isinstance(node.value, ast.Dict):
                        created = True
                        for k in node.value.keys:
                            vals = resolver.values(k) if k is not None else None
                            keys.extend(v for v in vals or [] if v not in keys)
                    elif isinstance(t, ast.Subscript) and _is_fp8_meta_expr(t.value, set()):
                        keys.extend(v for v in resolver.values(t.slice) or [] if v not in keys)
        if created:
            return keys, sym.name
    return [], None


def _scan_paths(tree: SourceTree) -> List[str]:
    out = []
    for entry in FP8_META_SCAN:
        if entry.endswith("/"):
            out.extend(p for p in tree.paths() if p.startswith(entry) and p.endswith(".py"))
        elif tree.has(entry):
            out.append(entry)
    return out


# --------------------------------------------------------------------------------------------
# Recipes
# --------------------------------------------------------------------------------------------


def _is_dataclass(cls: ast.ClassDef) -> bool:
    for dec in cls.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        name = _dotted(target) or ""
        if name.split(".")[-1] == "dataclass":
            return True
    return False


def _default_repr(node: ast.expr) -> Dict[str, Any]:
    is_lit, value = _literal(node)
    out: Dict[str, Any] = {"has_default": True, "literal": is_lit, "default": value if is_lit else None,
                           "default_src": ast.unparse(node)}
    return out


def dataclass_fields(tree: SourceTree, cls: Symbol) -> List[Dict[str, Any]]:
    """Fields in dataclass order (in-tree dataclass bases first); ClassVar/InitVar are skipped."""
    fields: Dict[str, Dict[str, Any]] = {}
    for sym in reversed(mro(tree, cls)):
        if not _is_dataclass(sym.node):
            continue
        for stmt in sym.node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                ann = ast.unparse(stmt.annotation)
                if "ClassVar" in ann or "InitVar" in ann:
                    continue
                entry: Dict[str, Any] = {"name": stmt.target.id, "annotation": ann}
                if stmt.value is None:
                    entry["has_default"] = False
                else:
                    value = stmt.value
                    # field(default=...) / field(default_factory=...)
                    if isinstance(value, ast.Call) and (_dotted(value.func) or "").split(".")[-1] == "field":
                        kw = {k.arg: k.value for k in value.keywords}
                        if "default" in kw:
                            entry.update(_default_repr(kw["default"]))
                        else:
                            entry.update({"has_default": "default_factory" in kw, "literal": False,
                                          "default": None, "default_src": ast.unparse(value)})
                    else:
                        entry.update(_default_repr(value))
                # a redefined field keeps its original position (dataclass semantics)
                fields[stmt.target.id] = {**fields.get(stmt.target.id, {}), **entry}
    return list(fields.values())


def class_plain_attributes(cls: Symbol) -> List[str]:
    """Unannotated class-level assignments (class attributes, not dataclass fields)."""
    out = []
    for stmt in cls.node.body:
        if isinstance(stmt, ast.Assign):
            out.extend(t.id for t in stmt.targets if isinstance(t, ast.Name) and not t.id.startswith("__"))
    return out


def enum_members(cls: Symbol) -> Dict[str, Dict[str, Any]]:
    """``{member: {"max_fwd": .., "max_bwd": ..}}`` for ``Format``-like enums (values when literal)."""
    members: Dict[str, Dict[str, Any]] = {}
    for stmt in cls.node.body:
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
            continue
        name = stmt.targets[0].id
        if name.startswith("_"):
            continue
        info: Dict[str, Any] = {"value_src": ast.unparse(stmt.value)}
        if isinstance(stmt.value, ast.Call):
            for kw in stmt.value.keywords:
                is_lit, value = _literal(kw.value)
                if not is_lit and isinstance(kw.value, ast.Attribute) and isinstance(kw.value.value, ast.Name):
                    ref = members.get(kw.value.value.id, {})  # HYBRID = _FormatHelper(max_fwd=E4M3.max_fwd, ...)
                    if kw.value.attr in ref:
                        is_lit, value = True, ref[kw.value.attr]
                if is_lit and kw.arg:
                    info[kw.arg] = value
        members[name] = info
    return members


# --------------------------------------------------------------------------------------------
# Whole contract
# --------------------------------------------------------------------------------------------


def extract_contract(tree: SourceTree) -> Dict[str, Any]:
    """The contract of one TE source tree as a JSON-able dict (see the module docstring)."""
    contract: Dict[str, Any] = {"version": tree.version, "origin": tree.origin, "modules": {},
                                "functions": {}, "recipes": {}, "format": None, "fp8_meta": {}}
    init_keys: Dict[str, Any] = {}
    for name in MODULE_CLASSES:
        sym = resolve(tree, PYTORCH_PKG, name)
        if sym is None or not isinstance(sym.node, ast.ClassDef):
            contract["modules"][name] = None
            continue
        sig = callable_signature(tree, sym)
        sig["kwargs_forwarded"] = kwargs_forwarded(tree, sym)
        sig["bases"] = [s.name for s in mro(tree, sym)[1:]]
        sig["init_attributes"] = init_attributes(tree, sym)
        keys, owner = fp8_meta_init_keys(tree, sym)
        if owner is not None:
            init_keys[name] = {"keys": keys, "created_in": f"{owner}.__init__"}
        contract["modules"][name] = sig
    for name in AUTOCAST_FUNCTIONS:
        sym = resolve(tree, PYTORCH_PKG, name)
        contract["functions"][name] = callable_signature(tree, sym) if sym is not None else None
    for name in RECIPE_CLASSES:
        sym = resolve(tree, RECIPE_PKG, name)
        if sym is None or not isinstance(sym.node, ast.ClassDef):
            contract["recipes"][name] = None
            continue
        contract["recipes"][name] = {"defined_at": sym.where, "fields": dataclass_fields(tree, sym),
                                     "class_attributes": class_plain_attributes(sym)}
    fmt = resolve(tree, RECIPE_PKG, "Format")
    contract["format"] = enum_members(fmt) if fmt is not None else None
    written, dynamic = fp8_meta_writes(tree, _scan_paths(tree))
    contract["fp8_meta"] = {"init": init_keys, "written_keys": written, "dynamic": dynamic}
    return contract


def param_names(sig: Optional[Dict[str, Any]]) -> List[str]:
    return [p["name"] for p in (sig or {}).get("params", [])]


def main(argv: Optional[List[str]] = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sources", nargs="+", help="wheel/sdist path, or a TE version to fetch into the cache")
    args = parser.parse_args(argv)
    out = {}
    for src in args.sources:
        if Path(src).exists():
            path = Path(src)
        else:
            sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
            from te_contract.wheels import obtain_wheel

            path = obtain_wheel(src)
        tree = SourceTree.from_archive(path)
        out[tree.version or src] = extract_contract(tree)
    json.dump(out if len(out) > 1 else next(iter(out.values())), sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
