"""Decode-faithful perplexity: every scored token attends to its history as stored in the cache format."""
from __future__ import annotations

import math

import torch

from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.engine.scoring import iter_chunk_logits
from kvforge.kv.formats import get_format
from kvforge.kv.memory import blocks_for_tokens, bytes_per_block, bytes_per_token
from kvforge.kv.spec import KVCacheSpec
from kvforge.sampling_params import SamplingParams


def perplexity(engine: LLMEngine, token_ids: list[int], chunk_size: int = 128, segment: int | None = None) -> dict:
    """Perplexity of token_ids[1:] given their prefixes; optionally per segment of `segment` tokens."""
    targets = torch.tensor(token_ids)
    nll = torch.zeros(len(token_ids) - 1, dtype=torch.float64)
    for start, logits in iter_chunk_logits(engine, token_ids, chunk_size):
        n = min(logits.shape[0], len(token_ids) - 1 - start)
        if n <= 0:
            break
        logp = torch.log_softmax(logits[:n], dim=-1)
        nll[start: start + n] = -logp.gather(1, targets[start + 1: start + 1 + n, None])[:, 0].double()
    result = {"ppl": math.exp(nll.mean().item()), "tokens": len(token_ids)}
    if segment:
        result["segments"] = [math.exp(nll[i: i + segment].mean().item()) for i in range(0, len(nll), segment)]
    return result


def engine_for(loaded, num_tokens: int, block_size: int = 16, **options) -> LLMEngine:
    """An engine whose KV budget holds one sequence of num_tokens (plus headroom) in its format."""
    spec = KVCacheSpec.from_model_config(loaded.config)
    fmt = get_format(options.get("kv_cache_dtype", "fp32"), **(options.get("kv_cache_options") or {}))
    budget = (blocks_for_tokens(num_tokens, block_size) + 4) * bytes_per_block(spec, fmt, block_size)
    max_len = min(num_tokens + 1, loaded.config.max_position_embeddings)
    return LLMEngine(EngineConfig(kv_cache_memory=budget, block_size=block_size, max_model_len=max_len,
                                  enable_prefix_caching=False, **options), loaded)


def greedy_agreement(base: LLMEngine, other: LLMEngine, prompts: list[list[int]], max_tokens: int = 64) -> dict:
    """Fraction of greedy tokens that match the baseline, position by position, and exact-match prompts."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    def run(engine):
        ids = [engine.add_request(p, params) for p in prompts]
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        return [done[i] for i in ids]

    a, b = run(base), run(other)
    same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    return {"token_agreement": same / sum(len(r) for r in a), "identical_outputs": sum(ra == rb for ra, rb in zip(a, b)),
            "prompts": len(prompts), "max_tokens": max_tokens}


def ppl_eval(loaded, text: str, max_tokens: int = 4096, chunk_size: int = 128, agreement_prompts: int = 12,
             agreement_tokens: int = 64, **options) -> dict:
    """The format/policy's perplexity and the fp32 full-cache baseline, in one run on one text."""
    ids = loaded.tokenizer.encode(text)[:max_tokens]
    base = engine_for(loaded, len(ids))
    other = engine_for(loaded, len(ids), **options)
    p0 = perplexity(base, ids, chunk_size)["ppl"]
    p1 = perplexity(other, ids, chunk_size)["ppl"]
    result = {
        "ppl_baseline": p0,
        "ppl": p1,
        "delta_pct": 100.0 * (p1 - p0) / p0,
        "kv_bytes_per_token": bytes_per_token(other.spec, other.format, other.kv.block_size),
        "kv_bytes_per_token_baseline": bytes_per_token(base.spec, base.format, base.kv.block_size),
        "tokens": len(ids),
        "chunk_size": chunk_size,
        "options": {k: v for k, v in options.items()},
    }
    if agreement_prompts:
        step = max(1, (len(ids) - 256) // agreement_prompts)
        prompts = [ids[i * step: i * step + 32 + 16 * (i % 8)] for i in range(agreement_prompts)]
        result["greedy"] = greedy_agreement(base, other, prompts, agreement_tokens)
    return result
