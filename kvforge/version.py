"""The package version: derived from git where kvforge runs from a checkout (an editable install's metadata is
frozen at install time), else the installed metadata (setuptools-scm wrote it at build), else FALLBACK.

The scheme is setuptools-scm's default, so both say the same: on a tag vX.Y.Z, "X.Y.Z"; N commits past it,
"X.Y.(Z+1).devN+g<hash>"; with no tag, "0.1.devN+g<hash>" (N = commits in the history); uncommitted changes to
tracked files make it a dev version and add ".d<YYYYMMDD>" (UTC).
"""
from __future__ import annotations

import datetime
import functools
import re
import subprocess
from importlib import metadata
from pathlib import Path

FALLBACK = "0+unknown"
_ROOT = Path(__file__).resolve().parent.parent
_TAG = re.compile(r"^v?(\d+(?:\.\d+)*)-(\d+)-g([0-9a-f]+)$")


@functools.cache
def package_version() -> str:
    return from_git(_ROOT) or from_metadata() or FALLBACK


def from_metadata() -> str | None:
    try:
        return metadata.version("kvforge")
    except metadata.PackageNotFoundError:
        return None


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(root), *args], check=False, capture_output=True, text=True,
                              timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def from_git(root: Path) -> str | None:
    """The version of the checkout at `root` (None when root is not kvforge's own checkout or git is missing)."""
    if not (root / ".git").exists() or not (root / "pyproject.toml").is_file():
        return None
    node = (_git(root, "rev-parse", "HEAD") or "")[:9]
    if not node:
        return None
    dirty = bool(_git(root, "status", "--porcelain", "--untracked-files=no"))
    described = _TAG.match(_git(root, "describe", "--tags", "--long", "--match", "*[0-9]*") or "")
    if described:
        release, distance = described.group(1), int(described.group(2))
    else:
        release, distance = "0.0", int(_git(root, "rev-list", "--count", "HEAD") or 0)
    if distance == 0 and not dirty:
        return release
    parts = release.split(".")
    following = ".".join([*parts[:-1], str(int(parts[-1]) + 1)])
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d")
    return f"{following}.dev{distance}+g{node}" + (f".d{date}" if dirty else "")
