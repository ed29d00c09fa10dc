"""kvforge on a local Ray Serve: 2 replicas x 1 CPU behind one endpoint.

Greedy outputs equal the offline engine's; prefix routing keeps each system prompt's questions on one replica
(pow2 does not); per-key cache salts hold on every replica; a killed replica fails its own requests with an error
while the others complete, and Ray's replacement serves.
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import time

import httpx
import pytest

from kvforge.bench import prefix_routing as work

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "server"))  # faults.py

RAY_ENGINE = {"kv_cache_memory": 48 * 16 * 512, "max_model_len": 512, "max_num_seqs": 32}  # 48 blocks per replica
KEYS = ["key-a", "key-b"]


@pytest.fixture(scope="module")
def char_model(tmp_path_factory) -> str:
    from faults import write_tiny_char_model

    d = tmp_path_factory.mktemp("tiny-char-ray")
    write_tiny_char_model(d)
    return str(d)


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.serve.request_router")
    from kvforge.serve_ray.launcher import stop

    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=128 << 20, log_to_driver=False)
    try:
        yield
    finally:
        stop()


def deploy(model: str, routing: str, port: int, **server) -> str:
    from kvforge.serve_ray.launcher import RayDeployment, start
    from kvforge.server import ServerConfig

    d = RayDeployment({"model": model, **RAY_ENGINE}, ServerConfig(served_model_name="m", **server), num_replicas=2,
                      routing=routing, cpus_per_replica=1)
    return start(d, port=port)


pytestmark = pytest.mark.timeout(600)
A, B = ({"Authorization": f"Bearer {k}"} for k in KEYS)


@pytest.fixture(scope="module")
def port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def prefix_url(ray_local, char_model, port) -> str:
    return deploy(char_model, "prefix", port, api_keys=KEYS)


@pytest.fixture(scope="module")
def pow2_url(ray_local, char_model, port) -> str:
    return deploy(char_model, "pow2", port, api_keys=KEYS)


def complete(url: str, prompt: str, headers: dict, **body) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, **body}
    return httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=120)


def test_outputs_equal_offline_greedy(prefix_url, char_model):
    from kvforge import LLM, SamplingParams

    prompts = ["The quick brown fox", "Once upon a time, in a village by the sea,", "KV caches store keys and"]
    offline = LLM(char_model, **RAY_ENGINE).generate(prompts, SamplingParams(temperature=0, max_tokens=12,
                                                                             ignore_eos=True))
    for prompt, want in zip(prompts, offline):
        r = complete(prefix_url, prompt, A)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want.text
    with httpx.stream("POST", prefix_url + "/v1/completions", headers=A, timeout=120,
                      json={"prompt": prompts[1], "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                            "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == offline[1].text
    assert complete(prefix_url, prompts[0], {}).status_code == 401, "every replica checks the API key"


def test_bad_input_through_the_ingress_is_the_apps_400_or_a_413(prefix_url):
    """Ids past any vocabulary are routed anywhere and refused by the app (not a 503 from hashing them); a body past
    the server's limit is refused by the ingress itself; the endpoint keeps serving."""
    r = complete(prefix_url, [2**31] * 40, A)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    big = b'{"prompt": "' + b"x" * (4 << 20) + b'"}'
    r = httpx.post(prefix_url + "/v1/completions", content=big, headers={**A, "content-type": "application/json"},
                   timeout=120)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
    assert complete(prefix_url, "still serving", A).status_code == 200


def test_tenant_salts_isolate_across_replicas(prefix_url):
    prompt = "Tenant isolation: a prompt long enough to fill several whole sixteen-token blocks, twice over."
    first = complete(prefix_url, prompt, A, max_tokens=1)
    again = complete(prefix_url, prompt, A, max_tokens=1)
    other = complete(prefix_url, prompt, B, max_tokens=1)
    cached = [r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (first, again, other)]
    assert cached[0] == 0 and cached[1] > 0, cached
    assert other.headers["x-kvforge-replica"] == first.headers["x-kvforge-replica"], "routed by content, not key"
    assert cached[2] == 0, "key-b lands on the replica holding key-a's blocks and must not read them"
    replicas = {r.headers["x-kvforge-replica"] for r in (first, again, other)}
    metrics = _metrics_with_replicas(prefix_url, 2)
    assert 'kvforge_router_decisions_total{policy="prefix",decision="prefix_match"}' in metrics
    assert all(f'replica="{rid}"' in metrics for rid in replicas)


def _metrics_with_replicas(url: str, n: int, wait_s: float = 30) -> str:
    deadline = time.monotonic() + wait_s
    while True:
        text = httpx.get(url + "/metrics", timeout=30).text
        if f"kvforge_replicas {n}" in text or time.monotonic() > deadline:
            assert f"kvforge_replicas {n}" in text, text[-400:]
            return text
        time.sleep(0.5)


def _routing_run(url: str, seed: int) -> dict:
    systems = work.system_prompts(4, 160, seed)
    shots, duration = asyncio.run(work.run_workload(url, systems, work.questions(16, seed), 4, 4, api_key=KEYS[0]))
    return work.summarize(shots, [160 // 16 * 16 - 16] * 4, duration)


def test_prefix_routing_keeps_each_prompt_on_one_replica_pow2_does_not(prefix_url, request):
    prefix = _routing_run(prefix_url, seed=1)
    assert prefix["failed"] == 0 and prefix["replicas"] == 2, prefix
    assert prefix["affinity"] >= 0.9 and prefix["hit_rate"] >= 0.9, prefix
    pow2 = _routing_run(request.getfixturevalue("pow2_url"), seed=2)
    assert pow2["failed"] == 0, pow2
    assert pow2["affinity"] < 0.9 and pow2["hit_rate"] < prefix["hit_rate"], (prefix, pow2)


def test_killed_replica_fails_its_requests_and_is_replaced(pow2_url):
    import ray
    from ray import serve

    url = pow2_url
    prompts = [f"Request {i} streams for a long while:" for i in range(8)]
    replicas = [""] * len(prompts)

    async def stream(client: httpx.AsyncClient, i: int, started: asyncio.Event) -> tuple[str, str]:
        body = {"prompt": prompts[i], "max_tokens": 450, "temperature": 0, "ignore_eos": True, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            replica = replicas[i] = r.headers.get("x-kvforge-replica", "")
            outcome = "incomplete"
            async for line in r.aiter_lines():
                started.set()
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        outcome = "error:" + chunk["error"].get("code", "")
                    elif chunk["choices"][0]["finish_reason"] == "length":
                        outcome = "done"
            return replica, outcome

    async def run() -> list[tuple[str, str]]:
        async with httpx.AsyncClient(base_url=url, headers=A, timeout=300) as client:
            events = [asyncio.Event() for _ in prompts]
            tasks = [asyncio.create_task(stream(client, i, e)) for i, e in enumerate(events)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), timeout=120)
            ray.kill(ray.get_actor(f"SERVE_REPLICA::kvforge#KVForgeReplica#{replicas[0]}", namespace="serve"),
                     no_restart=True)
            return await asyncio.wait_for(asyncio.gather(*tasks), timeout=240)

    outcomes = asyncio.run(run())
    killed = replicas[0]
    on_killed = [o for rid, o in outcomes if rid == killed]
    on_other = [o for rid, o in outcomes if rid != killed]
    assert on_killed and on_other, outcomes
    assert all(o == "error:replica_unavailable" for o in on_killed), outcomes
    assert all(o == "done" for o in on_other), outcomes
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        states = serve.status().applications["kvforge"].deployments["KVForgeReplica"].replica_states
        if states.get("RUNNING", 0) == 2:
            break
        time.sleep(1)
    responses = [complete(url, f"after the kill {i}", A) for i in range(6)]
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    assert killed not in {r.headers["x-kvforge-replica"] for r in responses}
    metrics = _metrics_with_replicas(url, 2, wait_s=60)
    assert f'replica="{killed}"' not in metrics, "the replacement reports, the dead replica does not"
