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
import random
import time
from collections import Counter

from kvforge.bench.streamed import Result, stream_one

WORDS = ["cache", "block", "token", "prefix", "replica", "router", "engine", "layer", "head", "query", "key", "value",
         "batch", "stream", "decode", "prefill", "memory", "tier", "model", "rank", "shard", "latency", "window"]


Shot = tuple[int, Result]  # (system prompt index, its request's result)


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
                       api_key: str | None = None, cache_salt: str | None = None) -> tuple[list[Shot], float]:
    """(measured shots, their wall time); the warm-up round is sent first and not returned. A cache_salt keeps
    this run from reusing blocks an earlier run left in a shared tier."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers, timeout=600) as client:
        await asyncio.gather(*(_one(client, i, s + asks[0], max_tokens, cache_salt) for i, s in enumerate(systems)))

        async def gated(i: int, prompt: str) -> Shot:
            async with gate:
                return await _one(client, i, prompt, max_tokens, cache_salt)

        order = [(i, s + q) for q in asks[1:] for i, s in enumerate(systems)]
        start = time.perf_counter()
        shots = await asyncio.gather(*(gated(i, p) for i, p in order))
        return list(shots), time.perf_counter() - start


async def _one(client, system: int, prompt: str, max_tokens: int, cache_salt: str | None) -> Shot:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "cache_salt": cache_salt}
    return system, await stream_one(client, body)


def summarize(shots: list[Shot], cacheable: list[int], duration: float) -> dict:
    """cacheable[i]: tokens of system prompt i in whole blocks (what a hit can serve)."""
    ok = [(i, r) for i, r in shots if r.ok]
    possible = sum(cacheable[i] for i, _ in ok)
    hit = sum(min(r.cached_tokens, cacheable[i]) for i, r in ok)
    return {"hit_rate": hit / possible if possible else 0.0, "affinity": affinity(ok),
            "ttft_ms_mean": 1000 * sum(r.ttft for _, r in ok) / len(ok) if ok else 0.0,
            "output_tok_s": sum(r.output_tokens for _, r in ok) / duration if duration else 0.0,
            "completed": len(ok), "failed": len(shots) - len(ok), "replicas": len({r.replica for _, r in ok}),
            "errors": sorted({r.error for _, r in shots if not r.ok})[:3]}


def affinity(shots: list[Shot]) -> float:
    by_system: dict[int, Counter] = {}
    for i, r in shots:
        by_system.setdefault(i, Counter())[r.replica] += 1
    shares = [c.most_common(1)[0][1] / sum(c.values()) for c in by_system.values()]
    return sum(shares) / len(shares) if shares else 0.0
