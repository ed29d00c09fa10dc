"""Decode-faithful perplexity: every scored token attends to its history as stored in the cache format."""
from __future__ import annotations

import math
import time

import torch

from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.engine.scoring import iter_chunk_logits
from kvforge.errors import PromptTooLongError
from kvforge.kv.formats import format_for_model
from kvforge.kv.memory import blocks_for_tokens, bytes_per_token, pool_bytes
from kvforge.progress import Progress
from kvforge.sampling_params import SamplingParams

AGREEMENT_PROMPT_MEAN = 88  # agreement prompts are 32 + 16 * (i % 8) tokens long
EVAL_MAX_SEQS = 1  # formats size their fp16 staging per sequence: one sequence is what a real one gets


def perplexity(engine: LLMEngine, token_ids: list[int], chunk_size: int | None = None, segment: int | None = None,
               progress: str | None = None) -> dict:
    """Perplexity of token_ids[1:] given their prefixes; optionally per segment of `segment` tokens.
    progress: a label to show a bar on stderr under."""
    chunk_size = chunk_size or engine.kv.block_size
    bar = Progress(progress or "", len(token_ids), progress is not None)
    targets = torch.tensor(token_ids)
    nll = torch.zeros(len(token_ids) - 1, dtype=torch.float64)
    kv, seg_peaks, t0 = engine.kv, [], time.perf_counter()
    kv.peak_blocks_used = kv.allocator.num_used
    overall = 0
    for start, logits in iter_chunk_logits(engine, token_ids, chunk_size):
        if segment and start and start % segment < chunk_size:  # a segment ended: its peak KV, then restart
            seg_peaks.append(kv.peak_blocks_used * kv.block_bytes)
            overall, kv.peak_blocks_used = max(overall, kv.peak_blocks_used), kv.allocator.num_used
        n = min(logits.shape[0], len(token_ids) - 1 - start)
        bar.update(logits.shape[0])
        if n <= 0:
            break
        logp = torch.log_softmax(logits[:n], dim=-1)
        nll[start: start + n] = -logp.gather(1, targets[start + 1: start + 1 + n, None])[:, 0].double()
    overall = max(overall, kv.peak_blocks_used)
    bar.close()
    result = {"ppl": math.exp(nll.mean().item()), "tokens": len(token_ids), "peak_kv_bytes": overall * kv.block_bytes,
              "seconds": time.perf_counter() - t0, "chunk_size": chunk_size}
    if segment:
        result["segments"] = [math.exp(nll[i: i + segment].mean().item()) for i in range(0, len(nll), segment)]
        result["segment_peak_kv_bytes"] = seg_peaks + [kv.peak_blocks_used * kv.block_bytes]
    return result


def engine_for(loaded, num_tokens: int, block_size: int = 16, max_num_seqs: int = EVAL_MAX_SEQS, **options) -> LLMEngine:
    """An engine whose KV budget holds num_tokens in all (4 spare blocks per sequence) in its format,
    side buffers sized for max_num_seqs."""
    spec = loaded.config.kv_cache_spec()
    fmt = format_for_model(options.get("kv_cache_dtype", "fp32"), options.get("kv_cache_options"), loaded.config)
    cache_tokens = min(num_tokens, loaded.config.max_position_embeddings)  # streaming runs past it in a bounded cache
    budget = pool_bytes(spec, fmt, block_size, blocks_for_tokens(cache_tokens, block_size) + 4 * max_num_seqs,
                        max_num_seqs)
    max_len = min(num_tokens + 1, loaded.config.max_position_embeddings)
    options = {"kv_staging_share": 1.0, **options}  # the budget is sized for max_num_seqs' side buffers
    return LLMEngine(EngineConfig(kv_cache_memory=budget, block_size=block_size, max_model_len=max_len,
                                  max_num_seqs=max_num_seqs, enable_prefix_caching=False, **options), loaded)


def greedy_agreement(base: LLMEngine, other: LLMEngine, prompts: list[list[int]], max_tokens: int = 64,
                     progress: bool = False) -> dict:
    """Fraction of greedy tokens that match the baseline, position by position, and exact-match prompts."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    def run(engine, label):
        bar = Progress(label, len(prompts) * max_tokens, progress)
        ids = [engine.add_request(p, params) for p in prompts]
        done = {}
        while engine.has_unfinished_requests():
            outs = engine.step()
            bar.update(sum(len(o.new_token_ids) for o in outs))
            done.update({o.request_id: o.token_ids for o in outs if o.finished})
        bar.close()
        return [done[i] for i in ids]

    a, b = run(base, "greedy agreement, baseline"), run(other, "greedy agreement, technique")
    same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    return {"token_agreement": same / sum(len(r) for r in a), "identical_outputs": sum(ra == rb for ra, rb in zip(a, b)),
            "prompts": len(prompts), "max_tokens": max_tokens}


def agreement_prompt_count(requested: int, scored_tokens: int, agreement_tokens: int = 64) -> int:
    """Agreement prompts are bounded by the request: their prompt + generated tokens stay within the scored text."""
    per_prompt = AGREEMENT_PROMPT_MEAN + agreement_tokens
    return max(0, min(requested, scored_tokens // per_prompt))


def ppl_eval(loaded, text: str, max_tokens: int = 4096, chunk_size: int | None = None, agreement_prompts: int = 12,
             agreement_tokens: int = 64, segment: int | None = None, progress: bool = False, log=None,
             **options) -> dict:
    """The format/policy's perplexity and the fp32 full-cache baseline, in one run on one text."""
    ids = loaded.tokenizer.encode(text)[:max_tokens]
    agreement_prompts = agreement_prompt_count(agreement_prompts, len(ids), agreement_tokens)
    base = engine_for(loaded, len(ids), weights="fp32")  # the baseline: fp32 weights (dequantized) and cache
    other = engine_for(loaded, len(ids), **options)
    ctx = loaded.config.max_position_embeddings
    if len(ids) > ctx and other.length_limit <= ctx:
        raise PromptTooLongError(
            f"{len(ids)} tokens exceed the model's context of {ctx}; kv_policy {other.policy.name!r} would need RoPE "
            "positions past it. Use kv_policy='streaming' (positions inside a bounded cache) or fewer tokens")
    if log:
        log(f"scoring {len(ids):,} tokens with the fp32 full cache, then with the technique; then "
            f"{agreement_prompts} greedy agreement prompts x {agreement_tokens} tokens on both")
    r0 = perplexity(base, ids[:ctx], chunk_size, segment, "perplexity, fp32 baseline" if progress else None)
    r1 = perplexity(other, ids, chunk_size, segment, "perplexity, technique" if progress else None)
    p0, p1 = r0["ppl"], r1["ppl"]
    result = {
        "ppl_baseline": p0,
        "ppl": p1,
        "delta_pct": 100.0 * (p1 - p0) / p0,
        "peak_kv_bytes": r1["peak_kv_bytes"],
        "peak_kv_bytes_baseline": r0["peak_kv_bytes"],
        "seconds": r1["seconds"],
        "seconds_baseline": r0["seconds"],
        "baseline_tokens": len(ids[:ctx]),
        "kv_bytes_per_token": bytes_per_token(other.kv_spec, other.format, other.kv.block_size),
        "kv_bytes_per_token_baseline": bytes_per_token(base.kv_spec, base.format, base.kv.block_size),
        "tokens": len(ids),
        "chunk_size": r1["chunk_size"],
        "options": {k: v for k, v in options.items()},
        **({"segments": r1["segments"], "segment_peak_kv_bytes": r1["segment_peak_kv_bytes"],
            "segments_baseline": r0["segments"]} if segment else {}),
    }
    if agreement_prompts:
        step = max(1, (len(ids) - 256) // agreement_prompts)
        prompts = [ids[i * step: i * step + 32 + 16 * (i % 8)] for i in range(agreement_prompts)]
        result["greedy"] = greedy_agreement(base, other, prompts, agreement_tokens, progress)
    return result
