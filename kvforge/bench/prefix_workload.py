"""The prefix benchmark's workload: requests behind one shared system prompt, and running a batch of them."""
from __future__ import annotations

import random
import statistics
import time

from kvforge.bench.workload import random_tokens
from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.progress import Progress
from kvforge.sampling_params import SamplingParams


def run_requests(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, label: str, show: bool) -> tuple[dict, dict]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    progress = Progress(label, len(prompts), show)
    start = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    done, peak = {}, 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
                progress.update()
        peak = max(peak, engine.kv.allocator.num_used - engine.kv.stats()["kv_blocks_cached_idle"])
    progress.close()
    ttfts = sorted(done[i].metrics.ttft for i in ids)
    stats = {
        "total_s": time.perf_counter() - start,
        "ttft_mean_s": statistics.fmean(ttfts),
        "ttft_p50_s": ttfts[len(ttfts) // 2],
        "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        "hit_tokens": sum(done[i].metrics.cached_tokens for i in ids),
        "prompt_tokens": sum(len(p) for p in prompts),
        "peak_kv_bytes": peak * engine.kv.block_bytes,
    }
    return stats, {i: done[i] for i in ids}


def shared_prompts(vocab: int, num_requests: int, system_len: int, question_len: tuple[int, int],
                   seed: int) -> list[list[int]]:
    """One system prompt of system_len random tokens, each request's own question after it."""
    rng = random.Random(seed)
    system = random_tokens(rng, system_len, vocab)
    return [system + random_tokens(rng, rng.randint(*question_len), vocab) for _ in range(num_requests)]


def shared_prompt_config(caching: bool, system_len: int, question_len: tuple[int, int], max_tokens: int, budget: int,
                         max_num_seqs: int = 64, checkpoint_memory: int | None = None, **options) -> EngineConfig:
    return EngineConfig(kv_cache_memory=budget, enable_prefix_caching=caching, max_num_seqs=max_num_seqs,
                        max_model_len=system_len + question_len[1] + max_tokens + 16,
                        state_checkpoint_memory=checkpoint_memory, **options)
