"""`kvforge bench tiers`: TTFT of a second ask by where its prefix came from (pool, host, disk, redis, recompute),
swap vs recompute preemption under memory pressure, and two engines sharing one Redis.

Documents are random token ids (TTFT does not depend on content); each is asked twice in a shuffled order
with a short question, one request at a time. Disk reads are cold: each file is dropped from the page cache
(posix_fadvise DONTNEED) before it is read. Ratios come from one run, baseline in the same run.
"""
from __future__ import annotations

import random
import statistics
import tempfile
import time

from kvforge.bench.workload import random_tokens
from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.kv.formats import get_format
from kvforge.kv.memory import bytes_per_block, pool_bytes
from kvforge.kv.tiers.local_redis import LocalRedis
from kvforge.progress import Progress
from kvforge.sampling_params import SamplingParams

BLOCK = 16
TIERS = ("host", "disk", "redis")


def _engine(loaded, blocks: int, kv_dtype: str, tiers: list[str] | None, max_num_seqs: int = 4, **kw) -> LLMEngine:
    spec = loaded.config.kv_cache_spec()
    memory = pool_bytes(spec, get_format(kv_dtype), BLOCK, blocks, max_num_seqs)
    return LLMEngine(EngineConfig(kv_cache_memory=memory, kv_cache_dtype=kv_dtype, block_size=BLOCK, max_num_seqs=max_num_seqs,
                                  max_model_len=blocks * BLOCK, kv_tiers=tiers, kv_staging_share=1.0, **kw), loaded)


def _ask(engine: LLMEngine, prompt: list[int], max_tokens: int = 1):
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished and o.request_id == rid:
                return o


def _loaded_blocks(engine: LLMEngine) -> dict[str, int]:
    s = engine.stats()
    return {t: s.get(f"tier_{t}_loaded_blocks", 0) for t in TIERS}


def _source(out, before: dict, after: dict) -> str:
    if not out.metrics.cached_tokens:
        return "recompute"
    delta = {t: after[t] - before[t] for t in TIERS}
    tier = max(delta, key=delta.get)
    return tier if delta[tier] else "pool"


def tier_attribution(loaded, docs: int, doc_tokens: int, kv_dtype: str, pool_docs: int, host_docs: int, disk_docs: int,
                     redis_url: str, directory: str, seed: int, show: bool) -> dict:
    rng = random.Random(seed)
    vocab = loaded.config.vocab_size
    texts = [random_tokens(rng, doc_tokens, vocab) for _ in range(docs)]
    doc_blocks = -(-doc_tokens // BLOCK) + 2
    doc_bytes = doc_blocks * bytes_per_block(loaded.config.kv_cache_spec(), get_format(kv_dtype), BLOCK)
    tiers = [f"host:{host_docs * doc_bytes}", f"disk:{directory}:{disk_docs * doc_bytes}", redis_url]
    engine = _engine(loaded, pool_docs * doc_blocks, kv_dtype, tiers)
    engine.tiers.tiers[1].cold_reads = True
    order = [d for d in range(docs) for _ in range(2)]
    rng.shuffle(order)
    seen, ttft, second_cached = set(), {}, []
    progress = Progress("tiers: 2 asks per document", len(order), show)
    for d in order:
        prompt = texts[d] + random_tokens(rng, 16, vocab)
        engine.tiers.flush()  # stores finish between asks, as they would in the idle time of a real server
        before = _loaded_blocks(engine)
        out = _ask(engine, prompt)
        source = _source(out, before, _loaded_blocks(engine))
        ttft.setdefault(source, []).append(out.metrics.ttft)
        if d in seen:
            second_cached.append(out.metrics.cached_tokens / (doc_tokens // BLOCK * BLOCK))
        seen.add(d)
        progress.update()
    progress.close()
    stats = engine.stats()
    engine.close()
    mean = {s: statistics.fmean(v) for s, v in ttft.items()}
    base = mean.get("recompute")
    per_token = {t: stats[f"tier_{t}_stored_bytes"] / (stats[f"tier_{t}_stored_blocks"] * BLOCK)
                 for t in TIERS if stats[f"tier_{t}_stored_blocks"]}
    return {
        "second_pass_hit_rate": statistics.fmean(second_cached),
        "ttft_mean_s": mean,
        "asks_by_source": {s: len(v) for s, v in ttft.items()},
        "ttft_ratio": {s: (mean[s] / base if s in mean and base else None) for s in ("pool", *TIERS)},
        "bytes_per_token": per_token,
        "load_gbps": {t: stats[f"tier_{t}_load_gbps"] for t in TIERS},
        "load_p50_ms": {t: stats[f"tier_{t}_load_p50_ms"] for t in TIERS},
        "tier_failures": {t: stats[f"tier_{t}_failed_loads"] + stats[f"tier_{t}_failed_stores"] for t in TIERS},
    }


def swap_vs_recompute(loaded, requests: int, prompt_tokens: int, max_tokens: int, kv_dtype: str, seed: int,
                      show: bool, rounds: int = 2) -> dict:
    """Requests with long prompts and a pool that holds every prompt and one more block each: all are admitted,
    then their outputs outgrow the pool and the newest is preempted, to be recomputed (a prefill of its prompt and
    output so far) or swapped to host memory and back (a copy). The arms run in ABBA order (`rounds` runs of
    each), so a drift in the machine's load counts against both."""
    rng = random.Random(seed + 1)
    prompts = [random_tokens(rng, prompt_tokens, loaded.config.vocab_size) for _ in range(requests)]
    need = -(-(prompt_tokens + max_tokens) // BLOCK)
    blocks = max(need, requests * (-(-prompt_tokens // BLOCK) + 1))
    order = [m for r in range(rounds) for m in (("recompute", "swap") if r % 2 == 0 else ("swap", "recompute"))]
    runs: dict[str, list[dict]] = {"recompute": [], "swap": []}
    progress = Progress("tiers: pressure, recompute and swap", requests * len(order), show)
    for mode in order:
        engine = _engine(loaded, blocks, kv_dtype, ["host:4GiB"], max_num_seqs=requests, preemption_mode=mode,
                         enable_prefix_caching=False)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        ids = [engine.add_request(p, params) for p in prompts]
        done = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = o
                    progress.update()
        seconds = time.perf_counter() - start
        s = engine.stats()
        engine.close()
        runs[mode].append({"seconds": seconds, "preemptions": s["preemptions"],
                           "tokens_recomputed": s["preempted_tokens_recomputed"],
                           "swapped_out_blocks": s.get("swapped_out_blocks", 0),
                           "outputs": [done[i].token_ids for i in ids]})
    progress.close()
    out: dict = {"requests": requests, "prompt_tokens": prompt_tokens, "max_tokens": max_tokens, "pool_blocks": blocks,
                 "rounds": rounds}
    for mode, rs in runs.items():
        seconds = sum(r["seconds"] for r in rs)
        out[mode] = {"seconds": seconds, "output_tok_s": requests * max_tokens * len(rs) / seconds,
                     **{k: rs[0][k] for k in ("preemptions", "tokens_recomputed", "swapped_out_blocks")}}
    outputs = [r["outputs"] for rs in runs.values() for r in rs]
    out["same_outputs"] = all(o == outputs[0] for o in outputs)
    out["swap_vs_recompute_throughput"] = out["swap"]["output_tok_s"] / out["recompute"]["output_tok_s"]
    return out


def cross_replica(loaded, docs: int, doc_tokens: int, kv_dtype: str, redis_url: str, seed: int, show: bool) -> dict:
    rng = random.Random(seed + 2)
    vocab = loaded.config.vocab_size
    texts = [random_tokens(rng, doc_tokens, vocab) for _ in range(docs)]
    blocks = 2 * (-(-doc_tokens // BLOCK) + 2)
    first = _engine(loaded, blocks, kv_dtype, [redis_url])
    progress = Progress("tiers: replica 1 computes, replica 2 reuses", 2 * docs, show)
    a = []
    for t in texts:
        a.append(_ask(first, t + random_tokens(rng, 16, vocab)))
        progress.update()
    first.kv.reset_prefix_cache()
    first.close()
    second = _engine(loaded, blocks, kv_dtype, [redis_url])
    b = []
    for t in texts:
        b.append(_ask(second, t + random_tokens(rng, 16, vocab)))
        progress.update()
    progress.close()
    second.close()
    usable = doc_tokens // BLOCK * BLOCK
    return {"cross_replica_hit_rate": sum(o.metrics.cached_tokens for o in b) / (usable * docs),
            "first_replica_ttft_mean_s": statistics.fmean(o.metrics.ttft for o in a),
            "second_replica_ttft_mean_s": statistics.fmean(o.metrics.ttft for o in b),
            "cross_replica_ttft_ratio": statistics.fmean(o.metrics.ttft for o in b) / statistics.fmean(o.metrics.ttft for o in a)}


def tiers_bench(loaded, docs: int = 40, doc_tokens: int = 2000, kv_dtype: str = "int8", pool_docs: int = 3,
                host_docs: int = 8, disk_docs: int = 12, redis_url: str | None = None, pressure_requests: int = 4,
                pressure_output_tokens: int = 64,
                replica_docs: int = 8, seed: int = 0, show: bool = True) -> dict:
    with tempfile.TemporaryDirectory(prefix="kvforge-tiers-") as directory:
        server = LocalRedis(directory) if redis_url is None else None
        url = redis_url or server.url
        try:
            result = {"docs": docs, "doc_tokens": doc_tokens, "kv_dtype": kv_dtype, "pool_docs": pool_docs,
                      "host_docs": host_docs, "disk_docs": disk_docs}
            result.update(tier_attribution(loaded, docs, doc_tokens, kv_dtype, pool_docs, host_docs, disk_docs, url,
                                           directory, seed, show))
            result["pressure"] = swap_vs_recompute(loaded, pressure_requests, doc_tokens, pressure_output_tokens,
                                                   kv_dtype, seed, show)
            result["swap_vs_recompute_throughput"] = result["pressure"].pop("swap_vs_recompute_throughput")
            result.update(cross_replica(loaded, replica_docs, doc_tokens, kv_dtype, url, seed, show))
        finally:
            if server is not None:
                server.stop()
    return result
