"""A dead engine loop: requests get a 503 at once, /health turns unhealthy, and the process exits non-zero."""
import os
import subprocess
import sys

import httpx
from conftest import ServerThread
from server_ready import wait_healthy

DEADLINE = 30


def test_dead_loop_makes_health_fail_and_requests_fail_fast(char_engine):
    engine = char_engine()
    with ServerThread(engine) as s:
        assert httpx.get(s.url + "/health").status_code == 200

        def boom(*args, **kwargs):
            raise RuntimeError("engine broken on purpose")

        engine.has_unfinished_requests = boom  # the loop's next turn raises outside any request
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=DEADLINE)
        assert r.status_code == 503 and "engine broken on purpose" in r.json()["error"]["message"]
        h = httpx.get(s.url + "/health", timeout=DEADLINE)
        assert h.status_code == 503 and h.json()["error"]["code"] == "engine_unavailable"
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3, "stream": True},
                       timeout=DEADLINE)
        assert r.status_code == 503


def test_server_process_exits_nonzero_when_its_loop_dies(char_dir):
    script = os.path.join(os.path.dirname(__file__), "dying_server.py")
    proc = subprocess.Popen([sys.executable, script, char_dir], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url, DEADLINE)
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=DEADLINE)
        assert r.status_code == 503 and "engine broken on purpose" in r.text
        assert proc.wait(DEADLINE) == 1
    finally:
        proc.kill()
        proc.wait()
