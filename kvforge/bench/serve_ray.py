"""kvforge bench serve --ray: the same shared-prefix workload under prefix-affinity and pow2 routing on Ray Serve.

Deploys the model on a local Ray (or --ray-address) once per routing policy, runs the workload of
bench/prefix_routing.py, and reports per policy hit_rate, affinity, ttft_ms_mean, output_tok_s; JSON keys
`prefix.hit_rate`, `pow2.hit_rate` and `ttft_ratio` (prefix mean TTFT / pow2 mean TTFT, same run).
With --redis (a private redis-server) or --kv-tier, both policies run again with that KV tier shared by
every replica: `prefix_tier.*`, `pow2_tier.*`, `ttft_ratio_tier`.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import sys
import tempfile

from kvforge.bench import prefix_routing as work

ARMS = ("prefix", "pow2")


def add_ray_options(p) -> None:
    g = p.add_argument_group("--ray: deploy the model on Ray Serve and compare routing policies")
    g.add_argument("--ray", action="store_true", help="run the Ray Serve routing benchmark (needs kvforge[ray])")
    g.add_argument("--engine-model", default=None, help="model each replica serves (default: the embedded SmolLM2)")
    g.add_argument("--kv-memory", default="64MiB", help="KV cache per replica")
    g.add_argument("--num-replicas", type=int, default=2, help="replicas")
    g.add_argument("--ray-address", default=None, help="join this Ray cluster (default: a local Ray)")
    g.add_argument("--system-prompts", type=int, default=4, help="distinct system prompts")
    g.add_argument("--questions", type=int, default=16, help="questions per system prompt")
    g.add_argument("--system-chars", type=int, default=2000, help="characters per system prompt")
    g.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request")
    g.add_argument("--kv-tier", action="append", default=None, metavar="TIER",
                   help="also run both policies with this KV tier on every replica, e.g. redis://HOST:PORT (default: none)")
    g.add_argument("--redis", action="store_true", help="also run both policies sharing a private redis-server tier")


def run_ray_bench(args) -> int:
    from kvforge.memcalc import parse_size
    from kvforge.serve_ray import require_ray

    require_ray()
    engine = {"model": args.engine_model, "kv_cache_memory": parse_size(args.kv_memory)}
    with contextlib.ExitStack() as stack:
        stack.enter_context(contextlib.redirect_stdout(sys.stderr))  # Ray's messages must not mix with the JSON
        tiers = list(args.kv_tier or [])
        if args.redis:
            from kvforge.kv.tiers.local_redis import LocalRedis

            tiers.append(stack.enter_context(LocalRedis(stack.enter_context(tempfile.TemporaryDirectory()))).url)
        result = ray_bench(engine, args.num_replicas, args.system_prompts, args.questions, args.system_chars,
                           args.max_tokens, args.max_concurrency or 2 * args.num_replicas, args.seed,
                           args.ray_address, tiers=tiers)
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
    else:
        for arm in [a for a in result if isinstance(result[a], dict) and "hit_rate" in result[a]]:
            r = result[arm]
            print(f"{arm:<7} hit_rate {r['hit_rate']:.3f}  affinity {r['affinity']:.3f}  ttft {r['ttft_ms_mean']:8.1f} ms"
                  f"  {r['output_tok_s']:7.1f} out tok/s  ({r['completed']} ok, {r['failed']} failed)")
        for key in ("ttft_ratio", "ttft_ratio_tier"):
            if key in result:
                print(f"{key} (prefix / pow2) {result[key]:.3f}")
    return 0 if all(r["failed"] == 0 for r in result.values() if isinstance(r, dict) and "failed" in r) else 1


def ray_bench(engine: dict, num_replicas: int, num_systems: int, num_questions: int, system_chars: int,
              max_tokens: int, concurrency: int, seed: int = 0, address: str | None = None,
              num_cpus: int | None = None, tiers: list[str] | None = None) -> dict:
    from kvforge.serve_ray.launcher import APP_NAME, RayDeployment, start, stop

    systems = work.system_prompts(num_systems, system_chars, seed)
    asks = work.questions(num_questions, seed)
    port = _free_port()
    result: dict = {"workload": {"system_prompts": num_systems, "questions": num_questions,
                                 "system_chars": system_chars, "max_tokens": max_tokens, "concurrency": concurrency,
                                 "num_replicas": num_replicas, "engine": engine, "seed": seed, "kv_tiers": tiers}}
    variants = [("", engine)] + ([("_tier", {**engine, "kv_tiers": tiers})] if tiers else [])
    try:
        for suffix, options in variants:
            for arm in ARMS:
                url = start(RayDeployment(options, num_replicas=num_replicas, routing=arm), port=port,
                            address=address, num_cpus=num_cpus)
                cacheable = [_cacheable_tokens(url, s) for s in systems]
                shots, duration = asyncio.run(work.run_workload(url, systems, asks, max_tokens, concurrency,
                                                                cache_salt=f"bench-{arm}{suffix}"))
                result[arm + suffix] = work.summarize(shots, cacheable, duration)
                from ray import serve

                serve.delete(APP_NAME)
            pow2 = result["pow2" + suffix]["ttft_ms_mean"]
            result["ttft_ratio" + suffix] = result["prefix" + suffix]["ttft_ms_mean"] / pow2 if pow2 else float("nan")
    finally:
        if address is None:
            stop()
    return result


def _cacheable_tokens(url: str, system: str, block_size: int = 16) -> int:
    """Whole blocks of the system prompt's tokens, less its last token (which may merge with the question's)."""
    import httpx

    n = httpx.post(url + "/tokenize", json={"prompt": system}, timeout=60).raise_for_status().json()["count"]
    return (n - 1) // block_size * block_size


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
