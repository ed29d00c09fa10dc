"""kvforge bench serve: drive a running OpenAI-compatible server and report latency and throughput.

JSON keys: ttft_ms, tpot_ms, itl_ms, e2e_ms are {p50, p90, p99, mean} in milliseconds (so `ttft_ms.p50` reads as
a key path); output_tok_s, total_tok_s, request_throughput (req/s); completed, failed, duration_s, plus the workload.
TTFT: request sent -> first streamed token. TPOT: (e2e - ttft) / (output tokens - 1) per request. ITL: the gap
between consecutive streamed chunks (one token each on kvforge).
"""
from __future__ import annotations

import asyncio
import json
import random
import sys
import time

from kvforge.bench.serve_ray import add_ray_options, run_ray_bench
from kvforge.bench.streamed import Result, stream_one
from kvforge.bench.workload import Request, random_workload
from kvforge.progress import Progress


def register_serve(bsub) -> None:
    p = bsub.add_parser("serve", help="latency and throughput of a running server (kvforge serve)")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--api-key", default=None, help="bearer key the server asks for (default: none)")
    p.add_argument("--model", default=None, help="model id (default: the first of GET /v1/models)")
    p.add_argument("--num-requests", type=int, default=64, help="requests in the workload")
    p.add_argument("--prompt-len", type=int, nargs=2, default=[32, 128], metavar=("MIN", "MAX"), help="prompt tokens, uniform in [MIN, MAX]")
    p.add_argument("--output-len", type=int, nargs=2, default=[32, 64], metavar=("MIN", "MAX"), help="output tokens, uniform in [MIN, MAX]")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrivals per second (default: inf, all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight (default: no limit)")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    add_ray_options(p)
    p.set_defaults(func=run_serve_bench)


def run_serve_bench(args) -> int:
    if args.ray:
        return run_ray_bench(args)
    result = asyncio.run(serve_bench(args.url, args.num_requests, tuple(args.prompt_len), tuple(args.output_len),
                                     args.request_rate, args.max_concurrency, args.model, args.api_key, args.seed,
                                     not args.no_progress))
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
    else:
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            s = result[key]
            print(f"{key:<20} p50 {s['p50']:9.1f}   p90 {s['p90']:9.1f}   p99 {s['p99']:9.1f}")
        for key in ("output_tok_s", "total_tok_s", "request_throughput", "completed", "failed", "duration_s"):
            v = result[key]
            print(f"{key:<20} {v:.3f}" if isinstance(v, float) else f"{key:<20} {v}")
    return 0 if result["failed"] == 0 else 1


async def serve_bench(url: str, num_requests: int, prompt_len: tuple[int, int], output_len: tuple[int, int],
                      request_rate: float = float("inf"), max_concurrency: int | None = None, model: str | None = None,
                      api_key: str | None = None, seed: int = 0, progress: bool = False) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max_concurrency or num_requests + 8)
    async with httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers, timeout=None, limits=limits) as client:
        card = (await client.get("/v1/models")).raise_for_status().json()["data"][0]
        model = model or card["id"]
        work = random_workload(num_requests, prompt_len, output_len, int(card.get("vocab_size", 32000)), seed)
        rng = random.Random(seed + 1)
        gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        bar = Progress("bench serve", num_requests, progress)

        async def one(req: Request, delay: float) -> Result:
            await asyncio.sleep(delay)
            if gate is None:
                r = await stream_one(client, _body(model, req), len(req.prompt_ids))
            else:
                async with gate:
                    r = await stream_one(client, _body(model, req), len(req.prompt_ids))
            bar.update()
            return r

        delays, t = [], 0.0
        for _ in work:
            delays.append(t)
            t += rng.expovariate(request_rate) if request_rate != float("inf") else 0.0
        start = time.perf_counter()
        results = await asyncio.gather(*(one(req, d) for req, d in zip(work, delays)))
        duration = time.perf_counter() - start
        bar.close()
    return summarize(results, duration, {"url": url, "model": model, "num_requests": num_requests,
                                         "prompt_len": list(prompt_len), "output_len": list(output_len),
                                         "request_rate": request_rate if request_rate != float("inf") else "inf",
                                         "max_concurrency": max_concurrency, "seed": seed})


def _body(model: str, req: Request) -> dict:
    return {"model": model, "prompt": req.prompt_ids, "max_tokens": req.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _dist_ms(values: list[float]) -> dict:
    ms = [v * 1000 for v in values]
    return {"p50": percentile(ms, 50), "p90": percentile(ms, 90), "p99": percentile(ms, 99),
            "mean": sum(ms) / len(ms) if ms else 0.0}


def summarize(results: list[Result], duration: float, workload: dict) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    errors = sorted({r.error for r in results if not r.ok})
    return {
        "ttft_ms": _dist_ms([r.ttft for r in ok]),
        "tpot_ms": _dist_ms([(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]),
        "itl_ms": _dist_ms([x for r in ok for x in r.itl]),
        "e2e_ms": _dist_ms([r.e2e for r in ok]),
        "output_tok_s": out_tokens / duration,
        "total_tok_s": (out_tokens + in_tokens) / duration,
        "request_throughput": len(ok) / duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": errors[:5],
        "duration_s": duration,
        "output_tokens": out_tokens,
        "prompt_tokens": in_tokens,
        "workload": workload,
    }
