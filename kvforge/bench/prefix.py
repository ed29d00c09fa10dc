"""Prefix sharing: requests behind one long system prompt, and multi-turn chats, caching off vs on."""
from __future__ import annotations

import random
import statistics
import time

from kvforge.bench.workload import random_tokens
from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.progress import Progress
from kvforge.sampling_params import SamplingParams


def _run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, label: str, show: bool) -> tuple[dict, dict]:
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


def shared_prompt_scenario(loaded, caching: bool, num_requests: int, system_len: int, question_len: tuple[int, int],
                           max_tokens: int, budget: int, seed: int, show: bool, max_num_seqs: int = 64,
                           checkpoint_memory: int | None = None) -> dict:
    prompts = shared_prompts(loaded.config.vocab_size, num_requests, system_len, question_len, seed)
    engine = LLMEngine(shared_prompt_config(caching, system_len, question_len, max_tokens, budget, max_num_seqs,
                                            checkpoint_memory), loaded)
    stats, outs = _run(engine, prompts, max_tokens, f"shared prompt, caching {'on' if caching else 'off'}", show)
    shareable = system_len // engine.kv.block_size * engine.kv.block_size * (num_requests - 1)
    stats["reuse_rate"] = stats["hit_tokens"] / shareable if shareable else 0.0
    stats["outputs"] = [out.token_ids for out in outs.values()]
    kv = engine.kv.stats()
    stats.update({k: v for k, v in kv.items() if k.startswith(("state_", "prefix_hits_short", "prefix_tokens_short"))})
    return stats


def multiturn_scenario(loaded, conversations: int, turns: int, question_len: tuple[int, int], max_tokens: int,
                       budget: int, seed: int, show: bool, max_num_seqs: int = 64) -> dict:
    rng = random.Random(seed + 1)
    vocab = loaded.config.vocab_size
    engine = LLMEngine(EngineConfig(kv_cache_memory=budget, max_num_seqs=max_num_seqs,
                                    max_model_len=turns * (question_len[1] + max_tokens) + 64), loaded)
    history = [[] for _ in range(conversations)]
    hits = shareable = 0
    for turn in range(turns):
        prompts = [h + random_tokens(rng, rng.randint(*question_len), vocab) for h in history]
        _, outs = _run(engine, prompts, max_tokens, f"multi-turn, turn {turn + 1}/{turns}", show)
        for c, (p, out) in enumerate(zip(prompts, outs.values())):
            if turn:
                hits += out.metrics.cached_tokens
                shareable += len(history[c]) // engine.kv.block_size * engine.kv.block_size
            history[c] = p + out.token_ids
    return {"reuse_rate": hits / shareable if shareable else 0.0, "hit_tokens": hits, "shareable_tokens": shareable,
            "conversations": conversations, "turns": turns}


def prefix_bench(loaded, num_requests: int = 100, system_len: int = 2000, question_len=(50, 200), max_tokens: int = 32,
                 budget: int = 4 << 30, conversations: int = 20, turns: int = 5, seed: int = 0, show: bool = True,
                 max_num_seqs: int = 64, checkpoint_memory: int | None = None, kv_tier: str | None = None,
                 model_path: str | None = None) -> dict:
    """checkpoint_memory: a recurrent model's state checkpoint budget (None: the engine's default, 1/8 of `budget`).
    kv_tier (with the model's `model_path`): also run the shared-prompt workload in two more processes through that
    tier (kvforge.bench.prefix_tiers), the second reusing what the first stored."""
    args = (num_requests, system_len, question_len, max_tokens, budget, seed, show, max_num_seqs, checkpoint_memory)
    off = shared_prompt_scenario(loaded, False, *args)
    on = shared_prompt_scenario(loaded, True, *args)
    off_outputs = off.pop("outputs")
    identical = off_outputs == on.pop("outputs")
    tiers = None
    if kv_tier is not None:
        from kvforge.bench.prefix_tiers import tier_scenario

        tiers = tier_scenario(model_path, kv_tier, off_outputs, *args)
    multi = multiturn_scenario(loaded, conversations, turns, (20, 60), max_tokens, budget, seed, show, max_num_seqs)
    return {
        **({"tiers": tiers} if tiers is not None else {}),
        "outputs_identical": identical,
        "off": off,
        "on": on,
        "ttft_reduction": 1 - on["ttft_mean_s"] / off["ttft_mean_s"],
        "reuse_rate": on["reuse_rate"],
        "peak_kv_reduction": 1 - on["peak_kv_bytes"] / off["peak_kv_bytes"],
        "speedup": off["total_s"] / on["total_s"],
        "multiturn": multi,
    }
