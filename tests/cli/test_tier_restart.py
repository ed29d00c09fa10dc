"""A restart keeps the disk tier: `kvforge generate` run twice hits on the second run in both write modes, and
`kvforge serve` writes its cached blocks on SIGTERM (a real process, a real signal)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import httpx
import pytest
from server_ready import wait_healthy

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "server"))
from faults import write_tiny_char_model

from kvforge.cli import main
from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.sampling_params import SamplingParams

PROMPT = "the quick brown fox jumps over the lazy dog, " * 2  # 90 characters: 5 whole blocks of 16 tokens
ENGINE = ["--kv-memory", "8MiB", "--max-model-len", "512"]
DEADLINE = 60


@pytest.fixture(scope="module")
def char_dir(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("tiny-char")
    write_tiny_char_model(d)
    return str(d)


def _generate(capsys, char_dir: str, tier_dir, *mode: str) -> dict:
    rc = main(["generate", PROMPT, "--raw", "--json", "--max-tokens", "3", "--temperature", "0", "--model", char_dir,
               "--kv-tier", f"disk:{tier_dir}:16MiB", *mode, *ENGINE])
    assert rc == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("mode", [[], ["--kv-tier-write-back"], ["--kv-tier-write-through"]])
def test_generate_twice_hits_the_disk_tier_the_second_time(capsys, char_dir, tmp_path, mode):
    first = _generate(capsys, char_dir, tmp_path, *mode)
    second = _generate(capsys, char_dir, tmp_path, *mode)
    assert first["stats"]["tier_hit_tokens"] == 0 and second["stats"]["tier_hit_tokens"] == 5 * 16
    assert second["token_ids"] == first["token_ids"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_writes_its_cache_on_sigterm(char_dir, tmp_path):
    tier_dir, port = tmp_path / "tier", _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "kvforge.cli", "serve", char_dir, "--port", str(port), "--log-level", "warning",
           "--kv-tier", f"disk:{tier_dir}:16MiB", "--kv-tier-write-back", *ENGINE]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        wait_healthy(proc, url, DEADLINE)
        r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0},
                       timeout=DEADLINE)
        assert r.status_code == 200
        assert not [f for f in os.listdir(tier_dir) if f.endswith('.kvb')]  # write-back: nothing stored while the pool has room
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(DEADLINE) == 0
    finally:
        proc.kill()
        err = proc.communicate()[1]
    assert "KV tiers: disk (write-back)" in err and "KV tiers closed: 5 cached blocks written at shutdown" in err
    assert len([f for f in os.listdir(tier_dir) if f.endswith('.kvb')]) == 5
    engine = LLMEngine(EngineConfig(model=char_dir, kv_tiers=[f"disk:{tier_dir}:16MiB"], kv_cache_memory="8MiB",
                                    max_model_len=512))
    engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats()["tier_hit_tokens"] == 5 * 16
    engine.close()
