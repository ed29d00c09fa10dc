"""Wait for a server subprocess to answer /health (its port may be bound before uvicorn listens on it)."""
import subprocess
import time

import httpx


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            assert httpx.get(url + "/health", timeout=timeout).status_code == 200
            return
        except httpx.TransportError:
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)
