"""Building the compiled operators: a failed build or KVFORGE_OPS=torch leaves the torch path, said once; a build
killed midway never blocks the next process, and a live one is waited on for a bounded time."""
import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch.utils.cpp_extension

from kvforge.ops import build
from kvforge.ops.build_lock import build_lock


def test_failed_build_falls_back_with_one_warning(monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing built there yet
    monkeypatch.setattr(build, "PACKAGE_BUILDS", tmp_path / "package")  # nor beside the sources

    def broken(**kwargs):
        raise RuntimeError("Error building extension 'kvforge_ops': g++: not found")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", broken)
    monkeypatch.delenv("KVFORGE_OPS", raising=False)
    with caplog.at_level(logging.WARNING, logger="kvforge.ops"):
        assert build.load_compiled.__wrapped__() is False
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "g++: not found" in warnings[0] and "torch reference path" in warnings[0]


def test_env_forces_the_torch_path(monkeypatch):
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **kw: (_ for _ in ()).throw(AssertionError("built")))
    monkeypatch.setenv("KVFORGE_OPS", "torch")
    assert build.load_compiled.__wrapped__() is False


def test_cache_key_follows_the_sources(monkeypatch, tmp_path):
    for name in ("a.cpp", "b.h"):
        (tmp_path / name).write_text("int x;")
    monkeypatch.setattr(build, "CSRC", tmp_path)
    before = build.build_key()
    (tmp_path / "b.h").write_text("int y;")
    assert build.build_key() != before
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert build.cache_dir() == tmp_path / "cache" / "kvforge" / "ops" / build.build_key()


def test_a_library_beside_the_sources_is_found_whatever_the_cache_home(monkeypatch, tmp_path):
    monkeypatch.setattr(build, "PACKAGE_BUILDS", tmp_path / "package")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "elsewhere"))
    monkeypatch.delenv("KVFORGE_OPS", raising=False)
    library = build.package_dir() / f"kvforge_ops_{build.build_key()}.so"
    library.parent.mkdir(parents=True)
    library.touch()
    loaded = []
    monkeypatch.setattr(build.torch.ops, "load_library", loaded.append)
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **kw: (_ for _ in ()).throw(AssertionError("built")))
    assert build.load_compiled.__wrapped__() is True
    assert loaded == [str(library)]


KILLED_BUILD = """
import sys
from pathlib import Path
from kvforge.ops import build
tmp = Path(sys.argv[1])
build.CSRC, build.SOURCES, build.PACKAGE_BUILDS = tmp / "csrc", ("tiny.cpp",), tmp / "_built"
build.package_dir().mkdir(parents=True)
(build.package_dir() / "lock").touch()  # what torch leaves when a build is killed midway
print(build.load_compiled())
"""


def test_a_build_killed_midway_never_blocks_the_next_process(tmp_path):
    """torch's leftover `lock` made every later load wait forever; now the next process builds (a one-line
    source here, not the real operators) and says so on stderr. A subprocess, so a regression fails, not hangs."""
    (tmp_path / "csrc").mkdir()
    (tmp_path / "csrc" / "tiny.cpp").write_text("int kvforge_tiny() { return 1; }\n")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    env.pop("KVFORGE_OPS", None)
    try:
        done = subprocess.run([sys.executable, "-c", KILLED_BUILD, str(tmp_path)], env=env, capture_output=True,
                              text=True, timeout=120, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail("load_compiled() waited on the lock a killed build left")
    assert done.returncode == 0, done.stderr
    expected = "True" if shutil.which("c++") or shutil.which("g++") else "False"
    assert done.stdout.split()[-1] == expected, done.stderr
    assert "compiling the CPU operators" in done.stderr
    assert not list(tmp_path.glob("_built/*/lock"))


HOLD_AND_WAIT = """
import sys, time
from pathlib import Path
from kvforge.ops.build_lock import build_lock
with build_lock(Path(sys.argv[1]), 1) as lock:
    (Path(sys.argv[1]) / "lock").touch()  # torch's baton, as during a real build
    print(lock.held, flush=True)
    time.sleep(120)
"""


def test_the_lock_of_a_killed_owner_is_taken_at_once(tmp_path):
    owner = subprocess.Popen([sys.executable, "-c", HOLD_AND_WAIT, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline().strip() == "True"
        with build_lock(tmp_path, timeout_s=0.2) as lock:
            assert not lock.held  # a live owner: waited on, then given up
        owner.kill()
        owner.wait(timeout=30)
        with build_lock(tmp_path, timeout_s=30) as lock:
            assert lock.held and lock.interrupted
            assert not (tmp_path / "lock").exists()
        with build_lock(tmp_path, timeout_s=0) as lock:
            assert lock.held and not lock.interrupted
    finally:
        owner.kill()
        owner.wait(timeout=30)


def test_a_live_build_is_waited_on_then_the_torch_path_is_used(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(build, "PACKAGE_BUILDS", tmp_path / "package")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("KVFORGE_OPS_WAIT_S", "0.3")
    monkeypatch.delenv("KVFORGE_OPS", raising=False)
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **kw: (_ for _ in ()).throw(AssertionError("built")))
    build.package_dir().mkdir(parents=True)
    with build_lock(build.package_dir(), timeout_s=0) as other, caplog.at_level(logging.WARNING, logger="kvforge.ops"):
        assert other.held
        assert build.load_compiled.__wrapped__() is False
    assert "still compiling" in caplog.text and "torch reference path" in caplog.text
