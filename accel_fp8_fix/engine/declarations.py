"""Patch-set declarations: the TOML files in ``patches/`` (shipped in the wheel as ``accel_fp8_fix/_patches``).

One file declares one patch set, pinned to one version window::

    name = "accelerate-1.13-1.16"
    kind = "fix"                      # "fix" (chosen by version) or "rehearsal" (CPU rehearsal only)
    summary = "..."
    internals = ["torch_fsdp2"]       # private internals used (accel_fp8_fix/internals/), checked at apply
    on_error = "accel_fp8_fix.diagnostics.notes:on_error"  # (exc, where, instance, args) for patches with notes
    [requires]                        # must be installed and inside the window
    accelerate = ">=1.13,<1.17"
    [compatible]                      # checked only when installed
    transformer-engine = ">=1.12"
    [tested]                          # releases the set was tested on: not a requirement (outside it, each
    transformers = ">=5.24,<5.26"     # internal is served only where its source hashes to a tested release's)
    [[patch]]
    target = "accelerate.accelerator:Accelerator.prepare"   # module:attribute.path
    wrapper = "accel_fp8_fix.fixes.prepare:prepare"          # a wrapt wrapper (wrapped, instance, args, kwargs)
                                                            # in fixes/; optional when `notes` is set
    notes = "Accelerator.prepare"                           # optional: an escaping exception goes through the
                                                            # set's on_error hook (labelled so), then re-raised
    on_return = "accel_fp8_fix.diagnostics.notes:after_prepare"  # optional: (instance, args, kwargs, result)
    signature = "(self, *args, device_placement=None)"      # optional: refuse to patch if it changed (a list:
                                                            # one per release of the window, any matches)
    upstream_sha256 = ["af2db72a4518597e"]                  # the wrapper re-implements this body: refuse
                                                            # the set if the upstream source changed
    fixes = ["A2"]                                          # labels of docs/failures.md
    why = "..."
    [[watch]]                                  # an upstream function this set mirrors without patching it
    target = "accelerate.utils.transformer_engine:apply_fp8_autowrap"
    upstream_sha256 = ["8fea42c5efb07129"]
    why = "..."

(Top-level keys come before the first table: in TOML a key after ``[requires]`` belongs to that table.)

Selection rule: among the sets of a kind, the one whose windows all contain the installed versions.
Windows of one kind must not overlap: if several sets match, that is a declaration error, reported
and nothing is patched.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from .versions import installed_versions, parse

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

KINDS = ("fix", "rehearsal")


class DeclarationError(ValueError):
    """A patch-set file is malformed."""


@dataclass(frozen=True)
class PatchSpec:
    target: str
    wrapper: str = ""  # "" = pass the call through (a patch that only notes errors)
    signature: str | tuple[str, ...] | None = None  # one, or the accepted ones (releases of the window differ)
    fixes: tuple[str, ...] = ()
    why: str = ""
    upstream_sha256: tuple[str, ...] = ()
    notes: str = ""  # label of the set's on_error hook for this target ("" = no hook)
    on_return: str = ""  # "module:function" called with (instance, args, kwargs, result) after a call returns

    @property
    def module(self) -> str:
        return self.target.partition(":")[0]

    @property
    def attribute(self) -> str:
        return self.target.partition(":")[2]


@dataclass(frozen=True)
class PatchSet:
    name: str
    kind: str
    requires: dict[str, SpecifierSet]
    compatible: dict[str, SpecifierSet] = field(default_factory=dict)
    patches: tuple[PatchSpec, ...] = ()
    summary: str = ""
    trigger: str = ""
    source: str = ""
    watches: tuple[PatchSpec, ...] = ()  # mirrored upstream functions (wrapper unused)
    internals: tuple[str, ...] = ()
    on_error: str = ""  # "module:function" called with (exc, where, instance, args) for patches with notes
    tested: dict[str, SpecifierSet] = field(default_factory=dict)  # tested, not required (transformers)

    def window(self) -> str:
        parts = [f"{name} {spec}" for name, spec in {**self.requires, **self.compatible}.items()]
        parts += [f"{name} {spec} (tested; outside it verified by source hash)" for name, spec in self.tested.items()]
        return ", ".join(parts)

    def outside_tested(self, versions: dict[str, str | None]) -> list[str]:
        """The installed releases outside the ``[tested]`` windows (``"transformers 5.26.0 (tested >=5.24,<5.26)"``)."""
        return [f"{name} {versions[name]} (tested {spec})" for name, spec in self.tested.items()
                if versions.get(name) is not None and not _contains(spec, versions[name])]

    def mismatches(self, versions: dict[str, str | None]) -> list[str]:
        """Why this set does not fit ``versions`` (empty when it fits)."""
        problems = []
        for name, spec in self.requires.items():
            found = versions.get(name)
            if found is None:
                problems.append(f"{name} is not installed (needs {spec})")
            elif not _contains(spec, found):
                problems.append(f"{name} {found} is outside {spec}")
        for name, spec in self.compatible.items():
            found = versions.get(name)
            if found is not None and not _contains(spec, found):
                problems.append(f"{name} {found} is outside {spec}")
        return problems


    def newer_only(self, versions: dict[str, str | None]) -> list[str]:
        """When every mismatch is a release newer than its window (above every upper bound, none older, nothing
        missing): those ``"torch 2.16.0 (window <2.16,>=2.11)"``; else empty."""
        newer = []
        for name, spec in {**self.requires, **self.compatible}.items():
            found = versions.get(name)
            if found is None:
                if name in self.requires:
                    return []
                continue
            if _contains(spec, found):
                continue
            parsed, uppers = parse(found), [Version(one.version) for one in spec if one.operator in ("<", "<=")]
            others_hold = all(_contains(SpecifierSet(str(one)), found) for one in spec if one.operator not in ("<", "<="))
            if parsed is None or not uppers or not others_hold or any(parsed < upper for upper in uppers):
                return []
            newer.append(f"{name} {found} (window {spec})")
        return newer


def _contains(spec: SpecifierSet, version: str) -> bool:
    parsed = parse(version)
    return parsed is not None and spec.contains(parsed, prereleases=True)


def _specifiers(table: dict, where: str) -> dict[str, SpecifierSet]:
    from packaging.specifiers import InvalidSpecifier, SpecifierSet  # ~35 ms to import: only when parsing

    out = {}
    for name, text in table.items():
        try:
            out[canonicalize_name(name)] = SpecifierSet(text)
        except InvalidSpecifier as exc:
            raise DeclarationError(f"{where}: invalid version specifier {text!r} for {name}") from exc
    return out


def parse_patch_set(data: dict, source: str = "<memory>") -> PatchSet:
    try:
        name, kind = data["name"], data.get("kind", "fix")
    except KeyError as exc:
        raise DeclarationError(f"{source}: missing key {exc}") from None
    if kind not in KINDS:
        raise DeclarationError(f"{source}: kind must be one of {KINDS}, got {kind!r}")
    on_error = data.get("on_error", "")
    patches = [_parse_patch(entry, i, source, on_error) for i, entry in enumerate(data.get("patch", []))]
    if not patches:
        raise DeclarationError(f"{source}: patch set {name!r} declares no patch")
    targets = [p.target for p in patches]
    if len(set(targets)) != len(targets):
        raise DeclarationError(f"{source}: a target is patched twice in {name!r}")
    watches = []
    for i, entry in enumerate(data.get("watch", [])):
        if "target" not in entry or not entry.get("upstream_sha256"):
            raise DeclarationError(f"{source}: watch #{i + 1} needs a target and upstream_sha256")
        watches.append(PatchSpec(target=entry["target"], wrapper="", why=entry.get("why", ""),
                                 upstream_sha256=tuple(entry["upstream_sha256"])))
    return PatchSet(
        name=name,
        kind=kind,
        requires=_specifiers(data.get("requires", {}), source),
        compatible=_specifiers(data.get("compatible", {}), source),
        patches=tuple(patches),
        summary=data.get("summary", ""),
        trigger=data.get("trigger") or patches[0].module.split(".")[0],
        source=source,
        watches=tuple(watches),
        internals=tuple(data.get("internals", ())),
        on_error=on_error,
        tested=_specifiers(data.get("tested", {}), source),
    )


def _check_ref(ref: str, source: str) -> None:
    if ref.count(":") != 1 or not all(ref.split(":")):
        raise DeclarationError(f"{source}: {ref!r} must look like 'package.module:Attribute.path'")


def _signature(value):
    return tuple(value) if isinstance(value, list) else value


def _parse_patch(entry: dict, i: int, source: str, on_error: str) -> PatchSpec:
    try:
        spec = PatchSpec(
            target=entry["target"],
            wrapper=entry.get("wrapper", ""),
            signature=_signature(entry.get("signature")),
            fixes=tuple(entry.get("fixes", ())),
            why=entry.get("why", ""),
            upstream_sha256=tuple(entry.get("upstream_sha256", ())),
            notes=entry.get("notes", ""),
            on_return=entry.get("on_return", ""),
        )
    except KeyError as exc:
        raise DeclarationError(f"{source}: patch #{i + 1} lacks {exc}") from None
    if not (spec.wrapper or spec.notes):
        raise DeclarationError(f"{source}: patch #{i + 1} ({spec.target}) needs a wrapper or notes")
    if spec.notes and not on_error:
        raise DeclarationError(f"{source}: patch #{i + 1} ({spec.target}) has notes but the set declares no on_error")
    for ref in (spec.target, spec.wrapper, spec.on_return, on_error):
        if ref:
            _check_ref(ref, source)
    return spec


def declarations_dir() -> Path:
    """``accel_fp8_fix/_patches`` in an installed wheel, else the source tree's ``patches/``."""
    package_dir = Path(__file__).resolve().parent.parent
    shipped = package_dir / "_patches"
    return shipped if shipped.is_dir() else package_dir.parent / "patches"


def load_patch_sets(directory: Path | str | None = None) -> list[PatchSet]:
    directory = Path(directory) if directory is not None else declarations_dir()
    sets = []
    for path in sorted(directory.glob("*.toml")):
        with open(path, "rb") as fh:
            try:
                data = tomllib.load(fh)
            except tomllib.TOMLDecodeError as exc:
                raise DeclarationError(f"{path}: {exc}") from None
        sets.append(parse_patch_set(data, source=str(path)))
    names = [s.name for s in sets]
    if len(set(names)) != len(names):
        raise DeclarationError(f"{directory}: two patch-set files use the same name")
    return sets


@dataclass
class Selection:
    """The outcome of choosing a patch set: the set (or None) and a sentence saying why."""

    kind: str
    patch_set: PatchSet | None
    reason: str
    versions: dict[str, str | None]
    candidates: list[PatchSet]

    @property
    def supported(self) -> bool:
        return self.patch_set is not None


def select_patch_set(
    sets: list[PatchSet], kind: str = "fix", versions: dict[str, str | None] | None = None
) -> Selection:
    candidates = [s for s in sets if s.kind == kind]
    names = sorted({n for s in candidates for n in (*s.requires, *s.compatible, *s.tested)})
    if versions is None:
        versions = installed_versions(names)
    else:
        versions = {canonicalize_name(k): v for k, v in versions.items()}
        versions = {n: versions.get(n) for n in names} | versions
    matching = [s for s in candidates if not s.mismatches(versions)]
    seen = ", ".join(f"{n} {versions.get(n) or 'not installed'}" for n in names)
    if len(matching) == 1:
        chosen = matching[0]
        return Selection(kind, chosen, f"installed {seen} fit window [{chosen.window()}]", versions, candidates)
    if len(matching) > 1:
        clash = ", ".join(f"{s.name} ({s.source})" for s in matching)
        return Selection(
            kind, None, f"declaration error: windows overlap, several {kind} sets match {seen}: {clash}", versions,
            candidates,
        )
    windows = "; ".join(f"{s.name}: [{s.window()}]" for s in candidates) or "none declared"
    return Selection(
        kind, None, f"unsupported versions: installed {seen}; supported windows: {windows}", versions, candidates
    )
