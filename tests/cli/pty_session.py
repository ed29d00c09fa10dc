"""Drive a command in a pseudo-terminal, as a person at a terminal would (stdlib pty, no pexpect)."""
from __future__ import annotations

import os
import pty
import re
import select
import signal
import time


class PtySession:
    def __init__(self, argv: list[str], env: dict[str, str]):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the pty is its controlling terminal, so ^C becomes SIGINT
            os.execve(argv[0], argv, env)
        self.output = ""

    def send(self, data: str) -> None:
        os.write(self.fd, data.encode())

    def expect(self, pattern: str, timeout: float = 120) -> str:
        """Read until the output after the last match contains pattern; returns that output."""
        deadline = time.monotonic() + timeout
        start = len(self.output)
        while not re.search(pattern, self.output[start:]):
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{pattern!r} not seen; output so far:\n{self.output[-2000:]}")
            ready, _, _ = select.select([self.fd], [], [], min(left, 1.0))
            if ready:
                try:
                    chunk = os.read(self.fd, 4096)
                except OSError:  # the child closed the terminal
                    chunk = b""
                if not chunk:
                    raise AssertionError(f"{pattern!r} not seen before exit; output:\n{self.output[-2000:]}")
                self.output += chunk.decode("utf-8", "replace")
        return self.output[start:]

    def wait(self, timeout: float = 60) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                os.close(self.fd)
                return os.waitstatus_to_exitcode(status)
            try:  # keep draining so the child never blocks on a full terminal
                if select.select([self.fd], [], [], 0.1)[0]:
                    self.output += os.read(self.fd, 4096).decode("utf-8", "replace")
            except OSError:
                time.sleep(0.05)
        self.kill()
        raise AssertionError("the process did not exit")

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
