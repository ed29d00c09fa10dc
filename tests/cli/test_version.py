"""`kvforge --version` names the commit it runs from (setuptools-scm's scheme), not a fixed "0.1.0"."""
from __future__ import annotations

import datetime
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvforge.version import from_git, package_version

ROOT = Path(__file__).resolve().parents[2]
needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          capture_output=True, text=True, check=True).stdout.strip()


@needs_git
@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="not run from a git checkout")
def test_cli_version_names_this_checkouts_commit():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "kvforge.cli", "--version"], capture_output=True, text=True,
                         check=True, cwd=ROOT, env=env).stdout.strip()
    head = git(ROOT, "rev-parse", "HEAD")
    on_tag = subprocess.run(["git", "-C", str(ROOT), "describe", "--tags", "--exact-match"], check=False,
                            capture_output=True)
    if on_tag.returncode != 0 or git(ROOT, "status", "--porcelain", "--untracked-files=no"):
        assert ".dev" in out and f"+g{head[:9]}" in out
    assert out == f"kvforge {package_version()}" and out != "kvforge 0.1.0"


@needs_git
def test_versions_follow_tags_distance_and_local_changes(tmp_path):
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'kvforge'\n")
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", "pyproject.toml")
    git(tmp_path, "commit", "-q", "-m", "one")
    node = git(tmp_path, "rev-parse", "HEAD")[:9]
    assert from_git(tmp_path) == f"0.1.dev1+g{node}"
    git(tmp_path, "tag", "v1.2.0")
    assert from_git(tmp_path) == "1.2.0"
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'kvforge'\n# edited\n")
    today = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d")
    assert from_git(tmp_path) == f"1.2.1.dev0+g{node}.d{today}"
    git(tmp_path, "commit", "-q", "-am", "two")
    assert from_git(tmp_path) == f"1.2.1.dev1+g{git(tmp_path, 'rev-parse', 'HEAD')[:9]}"


def test_outside_a_checkout_there_is_no_git_version(tmp_path):
    (tmp_path / "pyproject.toml").write_text("")
    assert from_git(tmp_path) is None
