"""The shared-prefix workload behind `kvforge bench serve --ray`: S system prompts x Q questions, streamed.

One warm-up request per system prompt goes first (its miss is compulsory, on any router); the others follow
interleaved (prompt 0, 1, ..., S-1, 0, 1, ...) with bounded concurrency, so every replica sees every prompt
unless the router keeps each prompt on one replica.
hit_rate: prompt tokens served from a replica's prefix cache / cacheable tokens (each system prompt's whole
blocks), over the measured requests. affinity: share of each prompt's measured requests on the replica that
served most of them, averaged over prompts.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass

WORDS = ["cache", "block", "token", "prefix", "replica", "router", "engine", "layer", "head", "query", "key", "value",
         "batch", "stream", "decode", "prefill", "memory", "tier", "model", "rank", "shard", "latency", "window"]


@dataclass
class Shot:
    system: int
    ok: bool = False
    replica: str = ""
    cached: int = 0
    ttft: float = 0.0
    output_tokens: int = 0
    error: str = ""


def system_prompts(count: int, chars: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        words = [f"You are assistant {i}."]
        while sum(len(w) + 1 for w in words) < chars:
            words.append(rng.choice(WORDS))
        prompts.append(" ".join(words)[:chars])
    return prompts


def questions(count: int, seed: int) -> list[str]:
    rng = random.Random(seed + 1)
    return [f" Question {j}: what does {rng.choice(WORDS)} do to {rng.choice(WORDS)}? Answer:" for j in range(count)]


async def run_workload(url: str, systems: list[str], asks: list[str], max_tokens: int, concurrency: int,
                       api_key: str | None = None) -> tuple[list[Shot], float]:
    """(measured shots, their wall time); the warm-up round is sent first and not returned."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers, timeout=600) as client:
        await asyncio.gather(*(_one(client, i, s + asks[0], max_tokens) for i, s in enumerate(systems)))

        async def gated(i: int, prompt: str) -> Shot:
            async with gate:
                return await _one(client, i, prompt, max_tokens)

        order = [(i, s + q) for q in asks[1:] for i, s in enumerate(systems)]
        start = time.perf_counter()
        shots = await asyncio.gather(*(gated(i, p) for i, p in order))
        return list(shots), time.perf_counter() - start


async def _one(client, system: int, prompt: str, max_tokens: int) -> Shot:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    shot = Shot(system)
    start = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            shot.replica = resp.headers.get("x-kvforge-replica", "")
            if resp.status_code != 200:
                shot.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"
                return shot
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    shot.error = chunk["error"].get("message", "error")
                    return shot
                if chunk.get("choices") and shot.ttft == 0.0:
                    shot.ttft = time.perf_counter() - start
                if chunk.get("usage"):
                    shot.output_tokens = chunk["usage"]["completion_tokens"]
                    shot.cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
        shot.ok = shot.output_tokens > 0
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        shot.error = f"{type(e).__name__}: {e}"
    return shot


def summarize(shots: list[Shot], cacheable: list[int], duration: float) -> dict:
    """cacheable[i]: tokens of system prompt i in whole blocks (what a hit can serve)."""
    ok = [s for s in shots if s.ok]
    possible = sum(cacheable[s.system] for s in ok)
    hit = sum(min(s.cached, cacheable[s.system]) for s in ok)
    return {"hit_rate": hit / possible if possible else 0.0, "affinity": affinity(ok),
            "ttft_ms_mean": 1000 * sum(s.ttft for s in ok) / len(ok) if ok else 0.0,
            "output_tok_s": sum(s.output_tokens for s in ok) / duration if duration else 0.0,
            "completed": len(ok), "failed": len(shots) - len(ok), "replicas": len({s.replica for s in ok}),
            "errors": sorted({s.error for s in shots if not s.ok})[:3]}


def affinity(shots: list[Shot]) -> float:
    by_system: dict[int, Counter] = {}
    for s in shots:
        by_system.setdefault(s.system, Counter())[s.replica] += 1
    shares = [c.most_common(1)[0][1] / sum(c.values()) for c in by_system.values()]
    return sum(shares) / len(shares) if shares else 0.0
