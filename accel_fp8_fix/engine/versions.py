"""Installed distribution versions, read from metadata only (never imports torch or accelerate)."""

from __future__ import annotations

from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version


def installed_version(distribution: str) -> str | None:
    """The installed version string of ``distribution``, or None when it is not installed."""
    import importlib.metadata as md  # lazily: ~20 ms, paid only when versions are read

    try:
        return md.version(distribution)
    except md.PackageNotFoundError:
        # Metadata names are matched loosely by importlib; try the canonical spelling too.
        canonical = canonicalize_name(distribution)
        if canonical != distribution:
            try:
                return md.version(canonical)
            except md.PackageNotFoundError:
                return None
        return None


def installed_versions(distributions) -> dict[str, str | None]:
    return {canonicalize_name(d): installed_version(d) for d in distributions}


def parse(version: str) -> Version | None:
    try:
        return Version(version)
    except InvalidVersion:
        return None
