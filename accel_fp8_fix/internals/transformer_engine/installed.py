"""The installed Transformer Engine: its version, TE's empty meta package told apart, and :func:`check` — every TE
internal the job modules of this package declare, read from TE's source when a patch set is applied.

Each job module declares what it touches as ``(file under transformer_engine/, text)``: ``_SOURCES`` (must be
there), ``_FORKS`` (``(what, alternatives)``: one alternative must be there) and ``_GUARDED`` (``(file, sources)``:
checked when TE has that file). :func:`check` gathers them from every module of :data:`JOBS`; a name that is gone
refuses the set, naming it and the installed TE version. The sources of the opt-in paths (``*_SOURCES`` in
modules.py, float8_tensors.py) are checked when those paths are asked for, not here (tests/unit/test_internals.py
checks that every declaration is gathered by one or the other). TE not installed: nothing to check.
"""

from __future__ import annotations

from collections.abc import Mapping

from . import checkpoint, modules, recipes, scaling

JOBS = (modules, recipes, checkpoint, scaling)  # the modules whose declarations check() gathers


def te_version(versions: Mapping[str, str | None]) -> str | None:
    """The installed TE version in ``versions`` (distribution ``transformer-engine`` or ``transformer_engine``)."""
    return versions.get("transformer-engine") or versions.get("transformer_engine")


def meta_package_only(versions: Mapping[str, str | None]) -> str | None:
    """What is wrong when ``pip install transformer-engine`` (no ``[pytorch]``) gave TE's empty meta package — its
    Python with no compiled library and no ``transformer_engine_torch`` (TE then refuses at import: "Found empty
    `transformer-engine` meta package installed") — naming the fix; None otherwise. Read from metadata only; never
    said under the CPU rehearsal, whose kernel shim stands in for exactly those libraries."""
    from importlib import metadata

    from ... import settings

    installed = te_version(versions)
    if installed is None or settings.get(settings.REHEARSAL):
        return None
    try:
        metadata.version("transformer_engine_torch")
        return None
    except metadata.PackageNotFoundError:
        pass
    try:
        files = metadata.distribution("transformer-engine").files or ()
    except metadata.PackageNotFoundError:
        return None
    if any(str(f).endswith(".so") for f in files):
        return None  # a build from source: TE's libraries are in its own distribution
    return (f"transformer-engine {installed} is TE's meta package without its PyTorch extension "
            "(transformer_engine_torch is not installed): Transformer Engine refuses at import (\"Found empty "
            f"`transformer-engine` meta package installed\"), so FP8 cannot run; install "
            f"`pip install \"transformer-engine[pytorch]=={installed}\"` (or this package's `te` extra)")


def _declared_missing(root, job, version: str) -> list[str]:
    from .. import missing_from_sources

    problems = missing_from_sources(root, getattr(job, "_SOURCES", ()), version)
    for what, alternatives in getattr(job, "_FORKS", ()):
        if all(missing_from_sources(root, (alternative,), version) for alternative in alternatives):
            places = " or ".join(f"{text!r} in {root.name}/{name}" for name, text in alternatives)
            problems.append(f"{version}: internal {what} is gone (neither {places})")
    guarded = getattr(job, "_GUARDED", None)
    if guarded is not None and (root / guarded[0]).exists():
        problems += missing_from_sources(root, guarded[1], version)
    return problems


def check(versions: Mapping[str, str | None]) -> list[str]:
    from .. import package_root

    installed = te_version(versions)
    root = package_root("transformer_engine")
    if installed is None and root is None:
        return []  # TE not installed: nothing to check
    version = f"transformer-engine {installed}"
    if root is None:
        return [f"{version}: transformer_engine not found"]
    meta_only = meta_package_only(versions)
    if meta_only:  # not a reason to refuse the set (its bf16 / FSDP2 x TP fixes still apply): said once, by name
        from ..._log import warn_user

        warn_user(f"accel_fp8_fix: {meta_only}")
    return [problem for job in JOBS for problem in _declared_missing(root, job, version)]
