"""Step time while the Redis tier is paused (SIGSTOP) against the step time without tiers.

One long stream decodes while a new request with a fresh prompt arrives every few steps; each engine step is
timed. Run without tiers, with a Redis tier, and with a Redis tier that is paused for the whole run, then resumed. Steps are
reported all together and decode-only (every scheduled request computes one token): a step that also prefills
takes longer by its prompt tokens, and with Redis paused several requests whose lookups waited may prefill in one.
    python -m kvforge.bench.tier_stall [--model PATH] [--steps 60] [--every 4]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import time

from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.kv.tiers.local_redis import LocalRedis
from kvforge.models.loader import load_model
from kvforge.sampling_params import SamplingParams


def step_times(loaded, tiers: list[str] | None, steps: int, every: int, prompt_tokens: int
               ) -> tuple[list[float], list[bool]]:
    """Seconds of each step, and whether it was decode-only."""
    context = min(1024, loaded.config.max_position_embeddings)
    e = LLMEngine(EngineConfig(kv_tiers=tiers, max_model_len=context, kv_cache_memory=64 << 20), loaded)
    schedule, decode_only = e.scheduler.schedule, []

    def scheduled(*args):
        batch = schedule(*args)
        decode_only.append(all(n == 1 for n in batch.num_new_tokens))
        return batch

    e.scheduler.schedule = scheduled
    vocab = loaded.config.vocab_size
    e.add_request([(7 * i) % (vocab - 10) + 5 for i in range(32)],
                  SamplingParams(temperature=0, max_tokens=steps + 10, ignore_eos=True))
    times = []
    for s in range(steps):
        if s % every == 0:
            prompt = [(s * 131 + 17 * i) % (vocab - 10) + 5 for i in range(prompt_tokens)]
            e.add_request(prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        start = time.perf_counter()
        e.step()
        times.append(time.perf_counter() - start)
    flags = decode_only[:len(times)]
    while e.has_unfinished_requests():
        e.step()
    e.close()
    return times, flags


def summary(times: list[float], decode_only: list[bool]) -> dict:
    decodes = [t for t, d in zip(times, decode_only) if d]
    return {"steps": len(times), "median_ms": round(1e3 * statistics.median(times), 1),
            "max_ms": round(1e3 * max(times), 1), "decode_steps": len(decodes),
            "decode_median_ms": round(1e3 * statistics.median(decodes), 1), "decode_max_ms": round(1e3 * max(decodes), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=4, help="a new request every this many steps")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    args = ap.parse_args()
    loaded = load_model(args.model)
    step_times(loaded, None, 4, 2, args.prompt_tokens)  # warm-up
    plain, plain_decodes = step_times(loaded, None, args.steps, args.every, args.prompt_tokens)
    with tempfile.TemporaryDirectory() as d, LocalRedis(d) as redis:
        up, up_decodes = step_times(loaded, [redis.url], args.steps, args.every, args.prompt_tokens)
    with tempfile.TemporaryDirectory() as d, LocalRedis(d) as redis:
        os.kill(redis.process.pid, signal.SIGSTOP)
        try:
            paused, paused_decodes = step_times(loaded, [redis.url], args.steps, args.every, args.prompt_tokens)
        finally:
            os.kill(redis.process.pid, signal.SIGCONT)
    out = {"no_tiers": summary(plain, plain_decodes), "redis_up": summary(up, up_decodes),
           "redis_paused": summary(paused, paused_decodes)}
    out["paused_max_over_plain_max"] = round(out["redis_paused"]["max_ms"] / out["no_tiers"]["max_ms"], 2)
    out["paused_max_over_up_max"] = round(out["redis_paused"]["max_ms"] / out["redis_up"]["max_ms"], 2)
    out["paused_decode_max_over_plain_decode_median"] = round(
        out["redis_paused"]["decode_max_ms"] / out["no_tiers"]["decode_median_ms"], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
