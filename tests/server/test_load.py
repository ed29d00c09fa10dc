"""64 concurrent streaming clients, some disconnecting mid-stream: no 5xx, no leaked block, exact greedy outputs."""
import asyncio
import random
import time

import httpx
import openai

from kvforge.sampling_params import SamplingParams

NUM_CLIENTS = 64
SHARED = "You are a careful assistant. Answer briefly and precisely. "
TOPICS = ["the moon", "bread", "rivers", "the piano", "volcanoes", "bees", "chess", "glass"]
ABORTED = 'kvforge_requests_finished_total{reason="abort"}'
PROMPTS = [SHARED + f"Tell me one fact about {t}." for t in TOPICS] + [f"Write a haiku about {t}:" for t in TOPICS]


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def wait_idle(url: str, timeout: float = 30) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if m["kvforge_requests_running"] == 0 and m["kvforge_requests_waiting"] == 0:
            return m
        assert time.monotonic() < deadline, f"requests still in flight: {m}"
        time.sleep(0.1)


async def client_run(client: openai.AsyncOpenAI, model: str, prompt: str, max_tokens: int, quit_after: int | None):
    """The streamed text and finish reason, or None when this client hung up after `quit_after` chunks."""
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True)
    text, reason, chunks = "", None, 0
    async for chunk in stream:
        if quit_after is not None and chunks >= quit_after:
            await stream.response.aclose()
            return None
        chunks += 1
        text += chunk.choices[0].text
        reason = chunk.choices[0].finish_reason or reason
    return text, reason


def test_concurrent_streams_with_disconnects(server, offline, model_name):
    rng = random.Random(7)
    jobs = [(PROMPTS[i % len(PROMPTS)], 8 + (i % len(PROMPTS)) % 9) for i in range(NUM_CLIENTS)]
    quitters = set(rng.sample(range(NUM_CLIENTS), NUM_CLIENTS // 10))
    distinct = sorted(set(jobs))
    ref = offline.generate([p for p, _ in distinct], [SamplingParams(temperature=0, max_tokens=n) for _, n in distinct])
    want = {job: (o.text, o.finish_reason) for job, o in zip(distinct, ref)}
    before = metrics(server.url)

    async def run_all():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120) as client:
            return await asyncio.gather(*(
                client_run(client, model_name, p, n, rng.randint(0, n // 2) if i in quitters else None)
                for i, (p, n) in enumerate(jobs)), return_exceptions=True)

    started = time.monotonic()
    results = asyncio.run(run_all())
    elapsed = time.monotonic() - started
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    for i, (job, result) in enumerate(zip(jobs, results)):
        if i in quitters:
            assert result is None
        else:
            assert result == want[job], (job, result, want[job])

    m = wait_idle(server.url)
    finished = NUM_CLIENTS - len(quitters)
    assert m["kvforge_time_to_first_token_seconds_count"] - before["kvforge_time_to_first_token_seconds_count"] >= finished
    aborted = m.get(ABORTED, 0) - before.get(ABORTED, 0)
    assert 1 <= aborted <= len(quitters), "disconnected clients' requests were aborted in the engine"
    assert m["kvforge_kv_blocks_used"] == m["kvforge_kv_blocks_cached_idle"], "only idle prefix-cache blocks remain"
    assert httpx.post(server.url + "/reset_prefix_cache").status_code == 200
    m = metrics(server.url)
    assert m["kvforge_kv_blocks_used"] == 0 and m["kvforge_kv_blocks_free"] == m["kvforge_kv_blocks_total"]
    server.engine.kv.allocator.check()
    print(f"\n{NUM_CLIENTS} streaming clients ({len(quitters)} disconnected) in {elapsed:.1f}s")


def test_non_streaming_client_that_gives_up_is_aborted(server):
    before = metrics(server.url).get(ABORTED, 0)
    body = {"prompt": "Count from one to one thousand:", "max_tokens": 400, "ignore_eos": True, "temperature": 0}
    try:
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.5)
        raise AssertionError("400 tokens should take longer than 0.5 s")
    except httpx.ReadTimeout:
        pass
    m = wait_idle(server.url, timeout=10)
    assert m.get(ABORTED, 0) == before + 1
    assert m["kvforge_kv_blocks_used"] == m["kvforge_kv_blocks_cached_idle"]
