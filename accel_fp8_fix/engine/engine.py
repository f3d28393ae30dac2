"""Applies one patch set with wrapt: lazily on import of its target, all-or-nothing, idempotent, undoable.

A patch replaces ``owner.attr`` (found from ``module:Owner.attr``) by a :class:`FixWrapper` around the
original. Undo puts the original object back, but only where our wrapper is still the attribute's value:
when somebody wrapped the same attribute after us, their wrapper stays and ours is switched to a
pass-through in place (reported), so neither their patch nor the original behaviour is lost.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import threading
from contextvars import ContextVar
from dataclasses import dataclass

import wrapt

from .._log import warn_user
from .declarations import PatchSet, PatchSpec
from .errors import PatchError
from .import_hooks import when_imported

logger = logging.getLogger("accel_fp8_fix")

_CALLING: ContextVar[str | None] = ContextVar("accel_fp8_fix_calling_patch_set", default=None)
_APPLIED: set[str] = set()  # names of the patch sets applied in this process


def calling_patch_set() -> str | None:
    """Name of the patch set whose fix is running now (inside a fix: the fix's own set), else None."""
    return _CALLING.get()


def is_applied(name: str | None) -> bool:
    """Whether the patch set ``name`` is applied (not undone) in this process."""
    return name in _APPLIED


class FixWrapper(wrapt.FunctionWrapper):
    """Our wrapper type: the marker for idempotence and for telling our wrappers from foreign ones."""

    def __init__(self, wrapped, wrapper, spec: PatchSpec, patch_set: str):
        super().__init__(wrapped, self._gated(wrapper))
        self._self_fix_spec = spec
        self._self_fix_patch_set = patch_set
        self._self_fix_enabled = True

    def _gated(self, wrapper):
        def gate(wrapped, instance, args, kwargs):
            if not self._self_fix_enabled:
                return wrapped(*args, **kwargs)
            token = _CALLING.set(self._self_fix_patch_set)
            try:
                return wrapper(wrapped, instance, args, kwargs)
            finally:
                _CALLING.reset(token)

        return gate


@dataclass
class PatchState:
    spec: PatchSpec
    status: str = "pending"  # pending | applied | failed | restored | disabled-in-place
    detail: str = ""
    owner: object = None
    name: str = ""
    original: object = None
    wrapper: FixWrapper | None = None


def resolve_target(spec: PatchSpec):
    """(owner, attribute name, original object as stored on the owner) for ``spec.target``."""
    module = importlib.import_module(spec.module)
    *path, name = spec.attribute.split(".")
    owner = module
    for part in path:
        owner = getattr(owner, part)
    if name not in vars(owner):
        # Inherited attributes would be patched on the wrong class; the declaration must name the owner.
        raise AttributeError(f"{spec.target}: {getattr(owner, '__name__', owner)!s} has no attribute {name!r} of its own")
    return owner, name, vars(owner)[name]


def _pass_through(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs)


def with_hooks(spec: PatchSpec, wrapper, on_error=None, on_return=None):
    """``wrapper`` (None: pass the call through) with the declared hooks around it: ``on_return(instance, args,
    kwargs, result)`` after a call returns; ``on_error(exc, spec.notes, instance, args)`` when an exception
    escapes, which is then re-raised unchanged (an ``on_error`` hook that fails is logged, never raised; an
    ``on_return`` hook's exception propagates: it is part of the call, e.g. prepare's forward notes)."""
    wrapper = wrapper or _pass_through
    on_error = on_error if spec.notes else None
    if on_error is None and on_return is None:
        return wrapper

    def hooked(wrapped, instance, args, kwargs):
        try:
            result = wrapper(wrapped, instance, args, kwargs)
        except Exception as exc:
            if on_error is not None:
                try:
                    on_error(exc, spec.notes, instance, args)
                except Exception:  # noqa: BLE001 - a note must never replace the user's error
                    logger.debug("on_error hook failed for %s", spec.target, exc_info=True)
            raise
        if on_return is not None:
            on_return(instance, args, kwargs, result)
        return result

    hooked.__name__ = hooked.__qualname__ = getattr(wrapper, "__name__", "hooked")
    return hooked


def resolve_wrapper(ref: str):
    module, _, qualname = ref.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"wrapper {ref} is not callable")
    return obj


def source_sha256(original) -> str:
    """First 16 hex digits of the sha256 of the function's source lines (what a re-implementation was
    written against): from its first line (decorators included) to the last line its code covers, read
    with linecache — no tokenizing, a few microseconds."""
    import hashlib
    import linecache

    func = original.__func__ if isinstance(original, (staticmethod, classmethod)) else original
    func = inspect.unwrap(func)
    code = func.__code__
    last = max((line for *_, line in code.co_lines() if line is not None), default=code.co_firstlineno)
    for const in code.co_consts:  # nested functions / classes can end later than the outer body's last line
        if hasattr(const, "co_lines"):
            last = max([last, *(line for *_, line in const.co_lines() if line is not None)])
    lines = linecache.getlines(code.co_filename)
    if not lines:
        raise OSError(f"no source for {code.co_filename}")
    return hashlib.sha256("".join(lines[code.co_firstlineno - 1:last]).encode()).hexdigest()[:16]


def _check_upstream(spec: PatchSpec, original) -> None:
    if not spec.upstream_sha256:
        return
    try:
        found = source_sha256(original)
    except (OSError, TypeError):
        found = "unreadable"
    if found not in spec.upstream_sha256:
        raise PatchError(
            f"{spec.target} changed upstream (source sha256 {found}, written against "
            f"{', '.join(spec.upstream_sha256)}): this patch set re-implements or mirrors it and refuses to apply"
        )


def _signature_of(original) -> str:
    func = original.__func__ if isinstance(original, (staticmethod, classmethod)) else original
    return str(inspect.signature(func))


class Engine:
    """Owns one patch set's life: pending → applied (or failed) → restored."""

    def __init__(self, patch_set: PatchSet):
        self.patch_set = patch_set
        self.states = [PatchState(spec) for spec in patch_set.patches]
        self.active = False
        self.error: str = ""
        self._lock = threading.RLock()
        self._hook_registered = False

    # -- lifecycle -----------------------------------------------------------------------------------
    def activate(self, strict: bool = False) -> None:
        """Apply now if the trigger module is imported, else when it is (post-import hook)."""
        with self._lock:
            if self.active:
                return
            self.active = True
            self.error = ""
            self._strict = strict
            if not self._hook_registered:
                self._hook_registered = True
                when_imported(self.patch_set.trigger, self._on_import)
            else:
                import sys

                if self.patch_set.trigger in sys.modules:
                    self._on_import(sys.modules[self.patch_set.trigger])

    def _on_import(self, _module) -> None:
        # a hook fires once, even after deactivate(); an inactive engine ignores it.
        with self._lock:
            if not self.active or self.applied:
                return
            try:
                self.apply()
            except PatchError as exc:
                if self._strict:
                    raise
                warn_user(str(exc))

    @property
    def applied(self) -> bool:
        return any(s.status == "applied" for s in self.states)

    def apply(self) -> None:
        """Resolve and check every patch first, then swap them all in; roll back on any failure."""
        with self._lock:
            if self.applied:
                return
            self._check_set_level()
            prepared = []
            for state in self.states:
                if state.status == "disabled-in-place":
                    continue  # our earlier wrapper still sits under a foreign one: re-enabled below
                try:
                    owner, name, original = resolve_target(state.spec)
                    if isinstance(original, FixWrapper):
                        raise PatchError(
                            f"{state.spec.target} is already wrapped by patch set {original._self_fix_patch_set!r}"
                        )
                    if state.spec.signature is not None:
                        expected = state.spec.signature
                        expected = (expected,) if isinstance(expected, str) else expected
                        found = _signature_of(original)
                        if found not in expected:
                            raise TypeError(f"signature changed: expected {' or '.join(expected)}, found {found}")
                    _check_upstream(state.spec, original)
                    wrapper = self.wrapper_for(state.spec)
                except Exception as exc:  # noqa: BLE001 - every failure means "do not patch"
                    state.status, state.detail = "failed", f"{type(exc).__name__}: {exc}"
                    for other in self.states:
                        if other is not state and other.status == "pending":
                            other.detail = "not applied: another patch of the set failed"
                    self.error = (
                        f"accel_fp8_fix: patch set {self.patch_set.name!r} not applied (accelerate left untouched): "
                        f"{state.spec.target}: {state.detail}"
                    )
                    raise PatchError(self.error) from exc
                prepared.append((state, owner, name, original, wrapper))
            done = []
            try:
                for state, owner, name, original, wrapper in prepared:
                    fix = FixWrapper(original, wrapper, state.spec, self.patch_set.name)
                    setattr(owner, name, fix)
                    state.owner, state.name, state.original, state.wrapper = owner, name, original, fix
                    done.append(state)
            except Exception as exc:  # pragma: no cover - setattr on a module/class practically never fails
                for state in done:
                    setattr(state.owner, state.name, state.original)
                self.error = f"accel_fp8_fix: patch set {self.patch_set.name!r} rolled back: {exc}"
                raise PatchError(self.error) from exc
            for state in self.states:
                if state.status == "disabled-in-place":
                    state.wrapper._self_fix_enabled = True
                    done.append(state)
            for state in done:
                state.status, state.detail = "applied", ""
            _APPLIED.add(self.patch_set.name)
            logger.debug("patch set %s applied (%d patches)", self.patch_set.name, len(done))

    def wrapper_for(self, spec: PatchSpec):
        """The wrapt wrapper declared for ``spec``: its fix (or a pass-through) with the set's hooks."""
        on_error = resolve_wrapper(self.patch_set.on_error) if spec.notes else None
        on_return = resolve_wrapper(spec.on_return) if spec.on_return else None
        return with_hooks(spec, resolve_wrapper(spec.wrapper) if spec.wrapper else None, on_error, on_return)

    def _check_set_level(self) -> None:
        """The private internals the set relies on, and the upstream functions it mirrors: all present and
        unchanged, or nothing is applied (the error names the internal / function and the versions)."""
        problems = []
        if self.patch_set.internals:
            # by its full name: ``from .. import`` would re-import the package itself when the rehearsal's
            # bootstrap has handed it back (accel_fp8_fix/_bootstrap.py), activating the fixes
            from ..internals import DISTRIBUTIONS, check
            from .versions import installed_versions

            problems += check(self.patch_set.internals, installed_versions(DISTRIBUTIONS))
        for spec in self.patch_set.watches:
            try:
                _check_upstream(spec, resolve_target(spec)[2])
            except Exception as exc:  # noqa: BLE001
                problems.append(f"{spec.target}: {exc}")
        if problems:
            from .versions import installed_versions

            versions = ", ".join(f"{k} {v}" for k, v in installed_versions(("accelerate", "torch", "transformers")).items())
            self.error = (f"accel_fp8_fix: patch set {self.patch_set.name!r} not applied (accelerate left untouched; "
                          f"{versions}): " + "; ".join(problems))
            for state in self.states:
                if state.status == "pending":
                    state.detail = "not applied: the set's internals check failed"
            raise PatchError(self.error)

    def deactivate(self) -> list[str]:
        """Undo every patch; return warnings about foreign wrappers found on top of ours."""
        warnings_out = []
        with self._lock:
            self.active = False
            _APPLIED.discard(self.patch_set.name)
            for state in self.states:
                if state.status != "applied":
                    if state.status in ("failed", "pending"):
                        state.status, state.detail = "pending", ""
                    continue
                current = vars(state.owner).get(state.name)
                if current is state.wrapper:
                    setattr(state.owner, state.name, state.original)
                    state.status = "restored"
                else:
                    state.wrapper._self_fix_enabled = False
                    state.status = "disabled-in-place"
                    state.detail = (
                        f"{state.spec.target} was wrapped again after us ({type(current).__name__}); their wrapper "
                        "is kept and ours now passes calls straight through"
                    )
                    warnings_out.append(state.detail)
                    warn_user(f"accel_fp8_fix: {state.detail}")
            for state in self.states:
                if state.status == "restored":
                    state.status, state.wrapper, state.owner, state.original = "pending", None, None, None
        return warnings_out
