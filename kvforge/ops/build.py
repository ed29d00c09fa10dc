"""Build and load the compiled CPU operators (C++ through torch's extension tooling), once per process.

The shared library is built by `make install` (or on first use) into `kvforge/ops/_built/<key>` beside the
sources when that is writable, else `$XDG_CACHE_HOME/kvforge/ops/<key>` (default ~/.cache); both are looked up,
the package's first, so a process with another HOME still finds it. The key covers the sources, torch, Python
and the CPU's flags (it is built with -march=native). `KVFORGE_OPS=torch` skips it; without a compiler, or if the
build fails, the engine runs the torch path and says so once. One process builds at a time (`build_lock.py`): a
build killed midway is started again by the next process, and one still running is waited on for at most
`KVFORGE_OPS_WAIT_S` seconds (default 600), after which the waiting process runs the torch path.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

from kvforge.ops.build_lock import TORCH_LOCK, build_lock

log = logging.getLogger("kvforge.ops")
CSRC = Path(__file__).parent / "csrc"
PACKAGE_BUILDS = Path(__file__).parent / "_built"
SOURCES = ("paged_decode.cpp", "tiles.cpp", "packed_rows.cpp", "layers.cpp", "small_matmul.cpp", "panel_matmul.cpp",
           "int8_matmul.cpp", "qblock_matmul.cpp", "layer_bridge.cpp", "stage_append.cpp", "uniform_encode.cpp",
           "q8_lanes.cpp", "greedy.cpp")
FLAGS = ("-O3", "-march=native", "-fopenmp")
WAIT_S = 600.0


def disabled() -> bool:
    return os.environ.get("KVFORGE_OPS", "").lower() == "torch"


def cache_dir() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "kvforge" / "ops" / build_key()


def package_dir() -> Path:
    return PACKAGE_BUILDS / build_key()


def build_key() -> str:
    h = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):
        h.update(path.name.encode() + path.read_bytes())
    h.update(f"{torch.__version__}|{sys.version_info[:2]}|{platform.machine()}|{FLAGS}|{_cpu_flags()}".encode())
    return h.hexdigest()[:16]


def _cpu_flags() -> str:
    try:
        return next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return ""


@functools.cache
def load_compiled() -> bool:
    """True when the compiled CPU kernels are registered (built now if needed); False means torch path."""
    if disabled():
        log.info("kvforge ops: KVFORGE_OPS=torch, using the torch reference path")
        return False
    try:
        from torch.utils.cpp_extension import load

        os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"  # venv ninja
        name = f"kvforge_ops_{build_key()}"
        for directory in (package_dir(), cache_dir()):
            library = directory / f"{name}.so"
            if library.exists() and not (directory / TORCH_LOCK).exists():  # built before, no build under way
                torch.ops.load_library(str(library))
                return True
        writable = os.access(PACKAGE_BUILDS.parent, os.W_OK)
        directory = package_dir() if writable else cache_dir()
        directory.mkdir(parents=True, exist_ok=True)
        with build_lock(directory, _wait_s()) as lock:
            if not lock.held:
                log.warning("kvforge ops: another process is still compiling the CPU operators in %s after %.0f s "
                            "(KVFORGE_OPS_WAIT_S); using the torch reference path", directory, _wait_s())
                return False
            library = directory / f"{name}.so"
            if library.exists() and not lock.interrupted:  # built by the process we waited for
                torch.ops.load_library(str(library))
                return True
            print(f"kvforge: compiling the CPU operators into {directory} (once; about 1-3 minutes, later processes "
                  "load them; KVFORGE_OPS=torch skips this)", file=sys.stderr, flush=True)
            load(name=name, sources=[str(CSRC / s) for s in SOURCES], build_directory=str(directory),
                 extra_cflags=list(FLAGS), extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
        return True
    except (RuntimeError, OSError, ImportError, subprocess.SubprocessError) as e:  # no compiler/ninja, failed build
        log.warning("kvforge ops: compiled CPU kernels unavailable (%s: %s); using the torch reference path",
                    type(e).__name__, str(e).strip().splitlines()[-1] if str(e).strip() else "")
        return False


def _wait_s() -> float:
    try:
        return float(os.environ.get("KVFORGE_OPS_WAIT_S", WAIT_S))
    except ValueError:
        return WAIT_S


@functools.cache
def has_cpu_kernel(op: str) -> bool:
    """The compiled kernels are built and `op` (e.g. "kvforge::int8_linear") has a compiled CPU kernel; ops whose
    kernel needs CPU features this machine lacks (AVX-512, VNNI) have only their torch reference."""
    return load_compiled() and torch._C._dispatch_has_kernel_for_dispatch_key(op, "CPU")
