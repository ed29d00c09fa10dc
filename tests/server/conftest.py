"""A real kvforge server on 127.0.0.1 (uvicorn in a background thread) and an offline reference LLM."""
from __future__ import annotations

import os
import socket
import sys
import threading
import time
from typing import Self

import pytest
import torch
import uvicorn

from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.llm import LLM
from kvforge.server import ServerConfig, build_app

sys.path.insert(0, os.path.dirname(__file__))  # faults.py

if os.environ.get("OMP_NUM_THREADS"):
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

ENGINE = {"kv_cache_memory": 160 << 20, "max_model_len": 512, "max_num_seqs": 64}


class ServerThread:
    def __init__(self, engine: LLMEngine, config: ServerConfig | None = None):
        self.engine = engine
        self.app = build_app(engine, config)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> Self:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


def make_engine(loaded, **options) -> LLMEngine:
    return LLMEngine(EngineConfig(**{**ENGINE, **options}), loaded)


@pytest.fixture(scope="session")
def server(smol_loaded):
    with ServerThread(make_engine(smol_loaded)) as s:
        yield s


@pytest.fixture(scope="session")
def offline(smol_loaded) -> LLM:
    """The offline LLM API on its own engine over the same loaded weights."""
    return LLM.from_engine(make_engine(smol_loaded))


@pytest.fixture()
def client(server):
    from openai import OpenAI

    with OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def model_name(server) -> str:
    import httpx

    return httpx.get(server.url + "/v1/models").json()["data"][0]["id"]


CHAR_ENGINE = {"kv_cache_memory": 8 << 20, "max_model_len": 512, "max_num_seqs": 64}


@pytest.fixture(scope="session")
def char_dir(tmp_path_factory) -> str:
    """The tiny random llama with a one-token-per-character tokenizer (fast server tests with text prompts)."""
    from faults import write_tiny_char_model

    d = tmp_path_factory.mktemp("tiny-char")
    write_tiny_char_model(d)
    return str(d)


@pytest.fixture()
def char_engine(char_dir):
    """A fresh engine over a fresh load (fault tests patch the model), built by calling it with EngineConfig options."""
    from kvforge.models.loader import load_model

    return lambda **options: LLMEngine(EngineConfig(**{**CHAR_ENGINE, **options}), load_model(char_dir))
