"""build_lock: one process at a time compiles the operators into a build directory, and a build that was
killed never blocks the next one.

torch's own `lock` file (its FileBaton) names no owner, so a build interrupted by Ctrl-C or a kill leaves it
behind and every later `cpp_extension.load` into that directory waits on it forever. Ours, `kvforge.lock`
beside it, is held with flock: the kernel releases it when its owner dies, so it is never stale, and it
records the owner's pid for the message. While we hold ours no other kvforge build runs there, so a torch
`lock` found then was left by a killed build and is removed. A live build is waited on for at most
`timeout_s`; then the caller goes on without the compiled operators.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

LOCK = "kvforge.lock"
TORCH_LOCK = "lock"


@dataclass(frozen=True)
class BuildLock:
    held: bool  # False: another live process held it for timeout_s, so nothing may be built here now
    interrupted: bool = False  # a killed build's torch lock was found (and removed): its outputs may be partial


@contextlib.contextmanager
def build_lock(directory: Path, timeout_s: float, poll_s: float = 0.2) -> Iterator[BuildLock]:
    """Hold the build lock of `directory` for the block, waiting at most `timeout_s` for a live owner."""
    fd = os.open(directory / LOCK, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        if not _acquire(fd, directory, timeout_s, poll_s):
            yield BuildLock(held=False)
            return
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        interrupted = True
        try:
            (directory / TORCH_LOCK).unlink()  # left by a killed build: nobody else builds here now
        except FileNotFoundError:
            interrupted = False
        yield BuildLock(held=True, interrupted=interrupted)
    finally:
        os.close(fd)  # releases the flock


def _acquire(fd: int, directory: Path, timeout_s: float, poll_s: float) -> bool:
    deadline, said = time.monotonic() + timeout_s, False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            if not said:
                print(f"kvforge: waiting up to {timeout_s:.0f} s for process {_owner(fd)} to finish compiling the "
                      f"CPU operators in {directory}", file=sys.stderr, flush=True)
                said = True
            time.sleep(poll_s)


def _owner(fd: int) -> str:
    text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    return text or "?"
