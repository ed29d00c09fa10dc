"""What a verification step costs: one forward of 1 + k rows of a sequence against a one-row decode step.

The sequence holds a grounded prompt in its cache; each round times execute() of a plain decode step and of a
1 + k row verification step (drafts are copies of the last token, all rejected, never committed), in
alternating order, and the medians of the rounds are reported with the LM head's share split out.
"""
from __future__ import annotations

import statistics
import time

import torch

from kvforge.bench.spec import grounded_prompts
from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.engine.scheduler import ScheduledBatch
from kvforge.sampling_params import SamplingParams


def verify_cost(loaded, ks: tuple[int, ...] = (1, 3, 5), rounds: int = 9, passage_tokens: int = 400,
                prompt: list[int] | None = None) -> dict:
    """prompt: the cached context (default: a grounded prompt of passage_tokens)."""
    engine = LLMEngine(EngineConfig(kv_cache_memory=1 << 30, max_num_seqs=1, enable_prefix_caching=False,
                                    speculative={"method": "ngram", "num_speculative_tokens": max(ks)}), loaded)
    engine.add_request(prompt or grounded_prompts(loaded.tokenizer, 1, passage_tokens)[0], SamplingParams(max_tokens=8))
    engine.step()  # prefill
    seq, runner, model = engine.scheduler.running[0], engine.runner, loaded.model
    times: dict[int, list[tuple[float, float]]] = {k: [] for k in (0, *ks)}
    for r in range(rounds):
        for k in (0, *ks) if r % 2 == 0 else (*ks, 0)[::-1]:
            seq.draft_token_ids = [seq.token_ids[-1]] * k
            engine.kv.allocate_slots(seq, 1 + k)
            with torch.inference_mode():
                ids, meta, rows = runner.build_metadata(ScheduledBatch([seq], [1 + k]))
                start = time.perf_counter()
                hidden = model(ids, meta, engine.kv.pool)
                body = time.perf_counter()
                model.compute_logits(hidden[rows]).float().argmax(-1).tolist()
                times[k].append((body - start, time.perf_counter() - body))
    seq.draft_token_ids = []
    base = statistics.median(b + h for b, h in times[0])
    return {"context_tokens": seq.num_computed_tokens, "rounds": rounds,
            "steps": {f"rows{1 + k}": {"ms": 1e3 * statistics.median(b + h for b, h in t),
                                       "lm_head_ms": 1e3 * statistics.median(h for _, h in t),
                                       "vs_decode": statistics.median(b + h for b, h in t) / base}
                      for k, t in times.items()}}
