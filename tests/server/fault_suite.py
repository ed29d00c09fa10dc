"""The fault-injection run: 64 streaming clients (real HTTP, the official openai client) with random disconnects,
bad inputs and a slow reader that never reads, against a server whose model forward, sampler and tokenizer raise
on seeded calls. test_fault_injection.py asserts on its Report; `python tests/server/fault_suite.py` prints it."""
from __future__ import annotations

import asyncio
import gc
import json
import os
import random
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field

import httpx
import openai
from conftest import CHAR_ENGINE, ServerThread
from faults import FaultInjector, write_tiny_char_model

from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.llm import LLM
from kvforge.models.loader import load_model
from kvforge.sampling_params import SamplingParams
from kvforge.server import ServerConfig

NUM_CLIENTS = 64
DEADLINE_S = 60  # per client; a request still open after it counts as hung
SHARED = "You are a terse assistant. Reply in one line. "  # 3 blocks of 16 characters (= tokens) shared
SLOW_N, SLOW_MAX_TOKENS = 8, 440
BAD = {  # what a bad client sends (on top of a valid request) -> the param its 400 (413: the body) must name
    "n=0": ({"n": 0}, "n"), "n=99": ({"n": 99}, "n"), "logprobs=21": ({"logprobs": 21}, "logprobs"),
    "17 stops": ({"stop": [f"s{i}" for i in range(17)]}, "stop"), "max_tokens=10**6": ({"max_tokens": 10**6}, "max_tokens"),
    "token id 999": ({"prompt": [5, 999]}, "prompt"), "empty prompt": ({"prompt": []}, "prompt"),
    "huge body": ({"prompt": "x" * (5 << 20)}, None),
}


@dataclass
class Job:
    index: int
    kind: str  # stream | plain | quit | bad
    prompt: str
    max_tokens: int
    quit_after: int = 0
    bad: str = ""


@dataclass
class Result:
    job: Job
    outcome: str  # ok | quit | bad | error | hung
    texts: list[str] = field(default_factory=list)
    reasons: list[str | None] = field(default_factory=list)
    status: int | None = None
    message: str = ""


@dataclass
class Report:
    results: list[Result]
    expected: dict[tuple[str, int], tuple[str, str]]  # (prompt, max_tokens) -> offline greedy (text, finish_reason)
    injector: FaultInjector
    prompt_ids: dict[str, tuple[int, ...]]
    slow_reader_held_in_faults: tuple[int, int] = (0, 0)
    slow_reader_held: tuple[int, int] = (0, 0)
    released_after_close: list[bool] = field(default_factory=list)
    blocks_used_after_reset: int = -1
    after: list[Result] = field(default_factory=list)  # clients run once the faults are off

    def counts(self) -> dict:
        outcomes = [r.outcome for r in self.results]
        return {"requests": len(self.results) + 2 + len(self.after), "injected_faults": dict(sorted(self.injector.injected.items())),
                "injected_total": sum(self.injector.injected.values()),
                "completed": outcomes.count("ok"), "disconnected": outcomes.count("quit"),
                "bad_inputs_400": outcomes.count("bad"), "errors_returned": outcomes.count("error"),
                "hung": outcomes.count("hung"), "slow_reader_held_outputs": self.slow_reader_held[0],
                "slow_reader_held_tokens": self.slow_reader_held[1],
                "slow_reader_held_during_faults": self.slow_reader_held_in_faults[0], "leaked_blocks": self.blocks_used_after_reset,
                "after_faults_ok": sum(r.outcome == "ok" for r in self.after)}


def plan(seed: int) -> list[Job]:
    rng = random.Random(seed)
    kinds = ["stream"] * 40 + ["plain"] * 8 + ["quit"] * 8 + ["bad"] * 8
    rng.shuffle(kinds)
    bad = iter(sorted(BAD))
    jobs = []
    for i, kind in enumerate(kinds):
        prompt = SHARED + f"Q{i}: " + "".join(rng.choice("abcdefghij klmnop") for _ in range(rng.randint(3, 20)))
        jobs.append(Job(i, kind, prompt, rng.randint(8, 40), rng.randint(1, 4), next(bad) if kind == "bad" else ""))
    return jobs


async def run_client(client: openai.AsyncOpenAI, url: str, job: Job) -> Result:
    args = {"model": "m", "prompt": job.prompt, "max_tokens": job.max_tokens, "temperature": 0}
    try:
        if job.kind == "bad":
            extra, _ = BAD[job.bad]
            async with httpx.AsyncClient(timeout=DEADLINE_S) as h:
                r = await h.post(url + "/v1/completions", json={**args, **extra})
            return Result(job, "bad" if r.status_code in (400, 413) else "error", status=r.status_code, message=r.text)
        if job.kind == "plain":
            r = await client.completions.create(**args)
            return Result(job, "ok", [c.text for c in r.choices], [c.finish_reason for c in r.choices], 200)
        stream = await client.completions.create(**args, stream=True)
        text, reason, chunks = "", None, 0
        async for chunk in stream:
            if job.kind == "quit" and chunks >= job.quit_after:
                await stream.response.aclose()
                return Result(job, "quit")
            chunks += 1
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
        return Result(job, "ok", [text], [reason], 200)
    except openai.APIStatusError as e:
        return Result(job, "error", status=e.status_code, message=str(e.message))
    except openai.APIConnectionError as e:
        return Result(job, "error", status=None, message=f"{e.message} {e.__cause__!r}")
    except openai.APIError as e:  # an error event inside a stream that started with 200
        return Result(job, "error", status=200, message=str(e.message))


def open_slow_reader(url: str, prompt: str) -> socket.socket:
    """A streaming request (n=SLOW_N) on a socket with a tiny receive buffer that is never read."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.connect((host, int(port)))
    body = json.dumps({"prompt": prompt, "max_tokens": SLOW_MAX_TOKENS, "n": SLOW_N, "stream": True,
                       "temperature": 0, "ignore_eos": True}).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    sock.sendall(head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


async def run_clients(url: str, jobs: list[Job], seed: int) -> list[Result]:
    rng = random.Random(seed)
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=DEADLINE_S) as c:
        async def one(job: Job) -> Result:
            await asyncio.sleep(rng.random() * 0.5)  # staggered arrivals
            try:
                return await asyncio.wait_for(run_client(c, url, job), DEADLINE_S)
            except asyncio.TimeoutError:
                return Result(job, "hung")

        return list(await asyncio.gather(*(one(j) for j in jobs)))


def wait_idle(server: ServerThread, timeout: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout
    while server.engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine still has requests"
        time.sleep(0.05)


def run_fault_suite(model_dir: str, seed: int = 0) -> Report:
    jobs = plan(seed)
    offline = LLM.from_engine(LLMEngine(EngineConfig(**CHAR_ENGINE), load_model(model_dir)))
    distinct = sorted({(j.prompt, j.max_tokens) for j in jobs if j.kind != "bad"})
    outs = offline.generate([p for p, _ in distinct], [SamplingParams(temperature=0, max_tokens=m) for _, m in distinct])
    expected = {key: (o.text, o.finish_reason) for key, o in zip(distinct, outs)}
    prompt_ids = {p: tuple(offline.engine.tokenizer.encode(p)) for p, _ in distinct}

    engine = LLMEngine(EngineConfig(**CHAR_ENGINE), load_model(model_dir))
    rng = random.Random(seed)
    injector = FaultInjector(seed, at={"forward": set(rng.sample(range(4, 40), 3)), "sample": set(rng.sample(range(4, 40), 2))},
                             rate={"decode": 0.002, "encode": 0.02})
    server = ServerThread(engine, ServerConfig(served_model_name="m"))
    server.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)  # a slow network: accepted sockets inherit it
    with server, injector.installed(engine):
        slow = open_slow_reader(server.url, SHARED + "slow reader 1")
        results = asyncio.run(run_clients(server.url, jobs, seed))
        injector.enabled = False
        report = Report(results, expected, injector, prompt_ids)
        report.slow_reader_held_in_faults = held_after_idle(server)  # it may have been failed by a fault
        slow.close()
        report.released_after_close = [released(server)]
        slow = open_slow_reader(server.url, SHARED + "slow reader 2")
        report.after = asyncio.run(run_clients(server.url, [j for j in jobs if j.kind == "stream"][:8], seed))
        report.slow_reader_held = held_after_idle(server)
        slow.close()
        report.released_after_close.append(released(server))
        httpx.post(server.url + "/reset_prefix_cache", timeout=DEADLINE_S).raise_for_status()
        report.blocks_used_after_reset = engine.kv.allocator.num_used
    return report


def released(server: ServerThread, timeout: float = 10) -> bool:
    """Whether everything held for readers is let go once they hang up."""
    deadline = time.monotonic() + timeout
    while server.app.state.engine_loop.held_outputs() != (0, 0):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
        gc.collect()
    return True


def held_after_idle(server: ServerThread) -> tuple[int, int]:
    """(outputs, token ids) handed to handlers but not yet sent, once the engine has finished every request."""
    wait_idle(server)
    time.sleep(0.2)  # the last outputs reach their handlers
    gc.collect()  # mailboxes of finished handlers that only a reference cycle still holds
    return server.app.state.engine_loop.held_outputs()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: tiny_models
    with tempfile.TemporaryDirectory() as d:
        write_tiny_char_model(d)
        print(json.dumps(run_fault_suite(d, int(sys.argv[1]) if len(sys.argv) > 1 else 0).counts(), indent=1))
