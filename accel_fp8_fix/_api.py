"""activate() / deactivate() / report(): choose the patch set for the installed versions and run the engine."""

from __future__ import annotations

import sys
import threading

from . import settings
from .engine.errors import PatchError  # noqa: F401  (re-exported)
from .settings import OFF_VALUES, ON_VALUES  # noqa: F401  (re-exported: the accepted bool spellings)

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: `import accel_fp8_fix` stays free of typing, logging, dataclasses
if TYPE_CHECKING:
    from .engine.declarations import PatchSet, Selection
    from .engine.engine import Engine



def _fix_patch_sets() -> dict:
    """``ACCEL_FP8_FIX_PATCH_SET``'s choices: the fix sets of patches/*.toml by name (loaded on first read)."""
    from .engine.declarations import load_patch_sets

    return {s.name: s.summary for s in load_patch_sets() if s.kind == "fix"}


settings.provide_choices("ACCEL_FP8_FIX_PATCH_SET", _fix_patch_sets)  # settings imports nothing from the package


def _logger():
    """The package logger (``logging`` is imported on first use; ``_log`` adds the NullHandler)."""
    from ._log import logger

    return logger


class UnsupportedVersionError(RuntimeError):
    """Strict mode: the installed versions are outside every declared window."""


def env_flag(name: str) -> bool | None:
    """True / False for a set boolean setting, None when unset or empty; ValueError (naming the setting, the
    value and the accepted spellings) for anything else (accel_fp8_fix/settings.py)."""
    return settings.get(name)


def activation_mode() -> str:
    """How this process asked for activation (for report() and doctor)."""
    if env_flag("ACCEL_FP8_FIX") is False:
        return "disabled by ACCEL_FP8_FIX=0"
    if env_flag("ACCELERATE_FP8_ACCEL_FP8_FIX"):
        return "accelerate config (fp8_config: {accel_fp8_fix: true})"
    if env_flag("ACCEL_FP8_FIX"):
        return "environment (ACCEL_FP8_FIX=1)"
    return "import accel_fp8_fix"


class _State:
    def __init__(self):
        self.lock = threading.RLock()
        self.engines: dict = {}  # (kind, set name) -> Engine
        self.selection: Selection | None = None
        self.engine: Engine | None = None
        self.mode = "inactive"
        self.strict = False
        self.requested = False  # activate() was called (and not undone)
        self.hook_registered = False


_state = _State()


def _strict_from_env() -> bool:
    return bool(env_flag("ACCEL_FP8_FIX_STRICT"))


def choose_patch_set(kind: str = "fix", versions: dict | None = None) -> Selection:
    """The patch set for the installed (or given) versions; ``ACCEL_FP8_FIX_PATCH_SET`` forces one by name."""
    from .engine.declarations import Selection, load_patch_sets, select_patch_set

    sets = load_patch_sets()
    forced = None
    if kind == "fix":
        try:
            forced = settings.get("ACCEL_FP8_FIX_PATCH_SET")
        except ValueError as exc:  # unsupported: a warning, or UnsupportedVersionError when strict; doctor says it
            by_name = {s.name: s for s in sets if s.kind == kind}
            return Selection(kind, None, str(exc).removeprefix("accel_fp8_fix: "), versions or {},
                             list(by_name.values()))
    if forced:
        by_name = {s.name: s for s in sets if s.kind == kind}
        chosen = by_name[forced]
        return Selection(kind, chosen, f"forced by ACCEL_FP8_FIX_PATCH_SET={forced}", versions or {}, [chosen])
    selection = select_patch_set(sets, kind, versions)
    if kind == "fix" and not selection.supported and selection.reason.startswith("unsupported versions"):
        return _untested(selection) or selection
    return selection


def _would_try(selection: Selection) -> str:
    candidate = untested_candidate(selection)
    if candidate is None:
        return ""
    chosen, _ = candidate
    return (f"; ACCEL_FP8_FIX_ALLOW_UNTESTED=1 would try {chosen.name}, applied only if its apply-time checks pass "
            f"({verified(chosen)})")


def untested_candidate(selection: Selection):
    """(the newest set whose only misfits are releases newer than its windows, those releases) or None."""
    from packaging.version import Version

    fits = [(s, s.newer_only(selection.versions)) for s in selection.candidates]
    fits = [(s, newer) for s, newer in fits if newer]
    if not fits:
        return None
    return max(fits, key=lambda pair: [max((Version(one.version) for one in spec if one.operator in ("<", "<=")),
                                           default=Version("0")) for spec in pair[0].requires.values()])


def _untested(selection: Selection):
    """``ACCEL_FP8_FIX_ALLOW_UNTESTED=1``: the newest set over releases newer than its windows (never older)."""
    from .engine.declarations import Selection

    candidate = untested_candidate(selection)
    if candidate is None:
        return None
    if not settings.get("ACCEL_FP8_FIX_ALLOW_UNTESTED"):
        return Selection("fix", None, selection.reason + _would_try(selection), selection.versions,
                         selection.candidates)
    chosen, newer = candidate
    return Selection("fix", chosen, f"UNTESTED: newer than its window: {', '.join(newer)}; "
                     f"ACCEL_FP8_FIX_ALLOW_UNTESTED=1 applies {chosen.name} only if every apply-time check passes "
                     f"({verified(chosen)})", selection.versions, selection.candidates)


def verified(patch_set) -> str:
    """What the apply-time checks of ``patch_set`` verify, counted from its declaration."""
    hashed = sum(1 for p in patch_set.patches if p.upstream_sha256) + len(patch_set.watches)
    signatures = sum(1 for p in patch_set.patches if p.signature)
    return (f"{signatures} signatures, {hashed} upstream sources by sha256, the internals of "
            f"{len(patch_set.internals)} libraries: {', '.join(patch_set.internals)}")


def engine_for(patch_set: PatchSet) -> Engine:
    """One engine per patch set for the life of the process (its post-import callback, engine/import_hooks.py,
    cannot be unregistered)."""
    from .engine.engine import Engine

    key = (patch_set.kind, patch_set.name)
    with _state.lock:
        if key not in _state.engines:
            _state.engines[key] = Engine(patch_set)
        return _state.engines[key]


FIX_TRIGGER = "accelerate"  # fix sets are chosen and applied when accelerate is imported


def activate(strict: bool | None = None):
    """Choose the patch set for the installed versions and apply it: now if accelerate is imported,
    else when it is (so importing this package stays cheap: no version logic until then).

    Idempotent. Unsupported versions: a warning and nothing patched, or UnsupportedVersionError when
    ``strict`` (or ``ACCEL_FP8_FIX_STRICT=1``) — raised by the import of accelerate if that comes later.
    ``ACCEL_FP8_FIX=0`` makes this a no-op.
    """
    strict = _strict_from_env() if strict is None else strict
    with _state.lock:
        if env_flag("ACCEL_FP8_FIX") is False:
            _state.mode = activation_mode()
            _logger().info("accel_fp8_fix: not activated (ACCEL_FP8_FIX=0)")
            return report()
        if _state.requested and (_state.engine is None or _state.engine.active):
            return report()
        _state.requested, _state.strict, _state.mode = True, strict, activation_mode()
        if FIX_TRIGGER in sys.modules:
            _select_and_apply()
        elif not _state.hook_registered:
            from .engine.import_hooks import when_imported

            _state.hook_registered = True
            when_imported(FIX_TRIGGER, _on_accelerate_import)
        return report()


def _on_accelerate_import(_module) -> None:
    with _state.lock:
        if _state.requested and _state.engine is None:
            _select_and_apply()


def _select_and_apply() -> None:
    if _state.engine is not None:  # re-activation after deactivate(): same set, same engine
        _state.engine.activate(strict=_state.strict)
        return
    selection = _state.selection = choose_patch_set("fix")
    if not selection.supported:
        message = f"accel_fp8_fix: nothing patched: {selection.reason}"
        if _state.strict:
            raise UnsupportedVersionError(message)
        from ._log import warn_user

        warn_user(message)
        return
    _state.engine = engine_for(selection.patch_set)
    _state.engine.activate(strict=_state.strict)
    if selection.reason.startswith("UNTESTED") and _state.engine.applied:
        from ._log import warn_user

        warn_user(f"accel_fp8_fix: running on an untested release, every apply-time check passed: {selection.reason}")


def deactivate():
    """Undo every patch this package applied (exactly); foreign wrappers on top are kept and reported."""
    with _state.lock:
        _state.requested = False
        if _state.engine is None:
            _state.mode = "deactivated"
            return report()
        _state.engine.deactivate()  # warns about foreign wrappers it had to leave in place
        _state.mode = "deactivated"
        return report()


def activation_requested() -> bool:
    """activate() was called in this process (and not undone)."""
    return _state.requested


def active_patch_set() -> str | None:
    """Name of the applied fix set, or None (used by the rank-agreement check)."""
    engine = _state.engine
    return engine.patch_set.name if engine is not None and engine.applied else None


class Report:
    """What ``report()`` says; ``patches``: dicts of target, status, detail, fixes, why."""

    FIELDS = ("mode", "strict", "patch_set", "reason", "versions", "patches", "error")

    def __init__(self, mode: str, strict: bool, patch_set: str | None, reason: str, versions: dict, patches: list,
                 error: str = ""):
        self.mode, self.strict, self.patch_set, self.reason = mode, strict, patch_set, reason
        self.versions, self.patches, self.error = versions, patches, error

    def __eq__(self, other):
        return isinstance(other, Report) and self.as_dict() == other.as_dict()

    def __repr__(self) -> str:
        return "Report(" + ", ".join(f"{k}={getattr(self, k)!r}" for k in self.FIELDS) + ")"

    @property
    def applied(self) -> bool:
        return any(p["status"] == "applied" for p in self.patches)

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.FIELDS}

    def __str__(self) -> str:
        lines = [
            f"activation : {self.mode}{' (strict)' if self.strict else ''}",
            f"patch set  : {self.patch_set or 'none'}",
            f"why        : {self.reason or '-'}",
            "versions   : " + (", ".join(f"{k} {v or 'not installed'}" for k, v in self.versions.items()) or "-"),
        ]
        if self.error:
            lines.append(f"error      : {self.error}")
        for p in self.patches:
            detail = f"  ({p['detail']})" if p["detail"] else ""
            lines.append(f"  [{p['status']:>8}] {p['target']}  {','.join(p['fixes'])}{detail}")
        return "\n".join(lines)


def report() -> Report:
    """Which set, why, which targets are applied or pending, versions seen."""
    with _state.lock:
        selection, engine = _state.selection, _state.engine
        patches = []
        if engine is not None:
            patches = [
                {
                    "target": s.spec.target,
                    "status": s.status,
                    "detail": s.detail,
                    "fixes": list(s.spec.fixes),
                    "why": s.spec.why,
                }
                for s in engine.states
            ]
        pending = _state.requested and selection is None and FIX_TRIGGER not in sys.modules
        return Report(
            mode=_state.mode,
            strict=_state.strict,
            patch_set=engine.patch_set.name if engine is not None else None,
            reason=selection.reason if selection is not None else (
                "pending: the patch set is chosen when accelerate is imported" if pending else ""),
            versions=dict(selection.versions) if selection is not None else {},
            patches=patches,
            error=engine.error if engine is not None else "",
        )


__all__ = ["activate", "deactivate", "report", "Report", "UnsupportedVersionError", "PatchError", "choose_patch_set"]
