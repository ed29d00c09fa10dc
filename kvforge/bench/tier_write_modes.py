"""`kvforge bench tiers`: the host tier written back (blocks the pool evicts) vs written through (every block when
cached), on one workload: documents asked twice in a shuffled order, one request at a time, a pool smaller than the
documents. Write-through also copies what the pool still holds, so the host tier keeps fewer distinct blocks; both
pay one export per block. The arms run in ABBA order (`rounds` runs of each), so a drift in load counts against both.
"""
from __future__ import annotations

import random
import statistics
import time
from dataclasses import replace

from kvforge.bench.workload import random_tokens
from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.kv.formats import get_format
from kvforge.kv.memory import bytes_per_block, pool_bytes
from kvforge.progress import Progress
from kvforge.sampling_params import SamplingParams

BLOCK = 16
MODES = ("write-back", "write-through")


def host_write_modes(loaded, docs: int, doc_tokens: int, kv_dtype: str, pool_docs: int, host_docs: int, seed: int,
                     show: bool, rounds: int = 2) -> dict:
    rng = random.Random(seed + 3)
    vocab = loaded.config.vocab_size
    texts = [random_tokens(rng, doc_tokens, vocab) for _ in range(docs)]
    order = [d for d in range(docs) for _ in range(2)]
    rng.shuffle(order)
    prompts = [texts[d] + random_tokens(rng, 16, vocab) for d in order]
    doc_blocks = -(-doc_tokens // BLOCK) + 2
    spec, fmt = loaded.config.kv_cache_spec(), get_format(kv_dtype)
    host = f"host:{host_docs * doc_blocks * bytes_per_block(spec, fmt, BLOCK)}"
    config = EngineConfig(kv_cache_memory=pool_bytes(spec, fmt, BLOCK, pool_docs * doc_blocks, 1), kv_cache_dtype=kv_dtype,
                          block_size=BLOCK, max_num_seqs=1, max_model_len=pool_docs * doc_blocks * BLOCK, kv_tiers=[host])
    arms = [m for r in range(rounds) for m in (MODES if r % 2 == 0 else MODES[::-1])]
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    progress = Progress("tiers: host write-back vs write-through", len(prompts) * len(arms), show)
    for mode in arms:
        engine = LLMEngine(replace(config, kv_tier_write_through=mode == "write-through"), loaded)
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        seen, cached, start = set(), [], time.perf_counter()
        for d, prompt in zip(order, prompts):
            rid, done = engine.add_request(prompt, params), []
            while engine.has_unfinished_requests():
                done += [o for o in engine.step() if o.finished and o.request_id == rid]
            if d in seen:
                cached.append(done[0].metrics.cached_tokens)
            seen.add(d)
            engine.tiers.flush()
            progress.update()
        seconds = time.perf_counter() - start
        s = engine.stats()
        engine.close()
        runs[mode].append({"seconds": seconds, "hit_rate": sum(cached) / (len(cached) * (doc_tokens // BLOCK * BLOCK)),
                           "stored_blocks": s["tier_host_stored_blocks"]})
    progress.close()
    out = {m: {"seconds": statistics.fmean(r["seconds"] for r in rs), "second_ask_hit_rate": rs[0]["hit_rate"],
               "stored_blocks": rs[0]["stored_blocks"]} for m, rs in runs.items()}
    out["write_through_vs_back_time"] = out["write-through"]["seconds"] / out["write-back"]["seconds"]
    return out
