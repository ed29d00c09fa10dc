"""One engine run for the layer bridge's tests: greedy tokens of each prompt, bridged or per-op alike."""
from __future__ import annotations

from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine


def run_tokens(loaded, prompts, params, speculative=None, kv_dtype="fp32") -> list[list[int]]:
    engine = LLMEngine(EngineConfig(block_size=8, max_model_len=64, kv_cache_memory=1 << 22, kv_cache_dtype=kv_dtype,
                                    enable_prefix_caching=False, speculative=speculative), loaded)
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    return [done[i] for i in ids]
