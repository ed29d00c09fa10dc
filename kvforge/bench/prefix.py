"""Prefix sharing: requests behind one long system prompt, and multi-turn chats, caching off vs on."""
from __future__ import annotations

import random

from kvforge.bench.prefix_tiers import tier_scenario
from kvforge.bench.prefix_workload import run_requests as _run
from kvforge.bench.prefix_workload import shared_prompt_config, shared_prompts
from kvforge.bench.workload import random_tokens
from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine


def shared_prompt_scenario(loaded, caching: bool, num_requests: int, system_len: int, question_len: tuple[int, int],
                           max_tokens: int, budget: int, seed: int, show: bool, max_num_seqs: int = 64,
                           checkpoint_memory: int | None = None, prefill_order: str = "fcfs") -> dict:
    prompts = shared_prompts(loaded.config.vocab_size, num_requests, system_len, question_len, seed)
    engine = LLMEngine(shared_prompt_config(caching, system_len, question_len, max_tokens, budget, max_num_seqs,
                                            checkpoint_memory, prefill_order=prefill_order), loaded)
    stats, outs = _run(engine, prompts, max_tokens, f"shared prompt, caching {'on' if caching else 'off'}", show)
    shareable = system_len // engine.kv.block_size * engine.kv.block_size * (num_requests - 1)
    stats["reuse_rate"] = stats["hit_tokens"] / shareable if shareable else 0.0
    stats["outputs"] = [out.token_ids for out in outs.values()]
    kv = engine.kv.stats()
    stats.update({k: v for k, v in kv.items() if k.startswith(("state_", "prefix_hits_short", "prefix_tokens_short"))})
    return stats


def multiturn_scenario(loaded, conversations: int, turns: int, question_len: tuple[int, int], max_tokens: int,
                       budget: int, seed: int, show: bool, max_num_seqs: int = 64, prefill_order: str = "fcfs") -> dict:
    rng = random.Random(seed + 1)
    vocab = loaded.config.vocab_size
    engine = LLMEngine(EngineConfig(kv_cache_memory=budget, max_num_seqs=max_num_seqs,
                                    max_model_len=turns * (question_len[1] + max_tokens) + 64, prefill_order=prefill_order),
                       loaded)
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
                 model_path: str | None = None, prefill_order: str = "fcfs") -> dict:
    """checkpoint_memory: a recurrent model's state checkpoint budget (None: the engine's default, 1/8 of `budget`).
    kv_tier (with the model's `model_path`): also run the shared-prompt workload in two more processes through that
    tier (kvforge.bench.prefix_tiers), the second reusing what the first stored. prefill_order: EngineConfig's."""
    args = (num_requests, system_len, question_len, max_tokens, budget, seed, show, max_num_seqs, checkpoint_memory)
    off = shared_prompt_scenario(loaded, False, *args, prefill_order)
    on = shared_prompt_scenario(loaded, True, *args, prefill_order)
    off_outputs = off.pop("outputs")
    identical = off_outputs == on.pop("outputs")
    tiers = None
    if kv_tier is not None:
        tiers = tier_scenario(model_path, kv_tier, off_outputs, *args)
    multi = multiturn_scenario(loaded, conversations, turns, (20, 60), max_tokens, budget, seed, show, max_num_seqs,
                               prefill_order)
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
        "prefill_order": prefill_order,
    }
