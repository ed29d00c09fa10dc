"""kvzip with reuse: one context compressed once, many questions adopting its compressed blocks: a prefix hit rate
of at least 0.9 and the same answers as compressing the context again for each question; no block leaks."""
from __future__ import annotations

import pytest
import torch
from kvzip_reference import recompressed

from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.errors import ConfigError
from kvforge.sampling_params import SamplingParams

g = torch.Generator().manual_seed(5)
CONTEXT = [int(t) for t in torch.randint(1, 90, (120,), generator=g)]
QUESTIONS = [[int(t) for t in torch.randint(1, 90, (4,), generator=g)] for _ in range(16)]
REPEAT = [7, 8, 9, 10]
OPTIONS = {"budget": 0.5, "repeat_prompt": REPEAT, "chunk": 32}
ANSWER = 6


def _engine(loaded, reuse: bool, **kw) -> LLMEngine:
    cfg = {"kv_cache_memory": 4_000_000, "block_size": 8, "kv_policy": "kvzip",
           "kv_policy_options": {**OPTIONS, "reuse": reuse}}
    return LLMEngine(EngineConfig(**{**cfg, **kw}), loaded)


def _generate(engine, prompt, max_tokens):
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1))
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o if o.finished else out
    return out


def test_questions_reuse_the_compressed_context(peaky_loaded):
    engine = _engine(peaky_loaded, reuse=True)
    _generate(engine, CONTEXT, 1)  # the context on its own: scored, compressed and kept
    kept = engine.stats()
    assert kept["compressed_prefixes"] == 1 and kept["kv_compactions"] == 1
    assert kept["kv_blocks_used"] == kept["compressed_prefix_blocks"]  # the request is gone, its context kept
    rows = kept["compressed_prefix_blocks"] * 8
    assert len(CONTEXT) // 2 <= rows < len(CONTEXT) // 2 + 8  # the budget, rounded up to whole blocks
    # recompressing for each question, keeping as many rows (kvzip's next best up to the block boundary)
    reference = _engine(peaky_loaded, reuse=False, kv_policy_options={**OPTIONS, "budget": rows})
    for q in QUESTIONS:
        out = _generate(engine, CONTEXT + q, ANSWER)
        ids, lps = recompressed(reference, CONTEXT, q, ANSWER)
        assert list(out.token_ids) == ids
        torch.testing.assert_close(torch.tensor([lp["logprob"] for lp in out.logprobs]), torch.tensor(lps),
                                   atol=2e-4, rtol=1e-4)
    s = engine.stats()
    assert s["kv_compactions"] == 1  # no question compressed the context again
    assert s["prefix_hit_rate"] >= 0.9, s["prefix_hit_rate"]  # the context-only request (a miss) counted too
    assert s["prefix_hit_tokens"] == len(QUESTIONS) * len(CONTEXT)
    assert s["kv_blocks_used"] == s["compressed_prefix_blocks"]  # only the kept context holds blocks
    assert engine.kv.reset_prefix_cache() == s["compressed_prefix_blocks"]
    assert engine.kv.allocator.num_used == 0
    engine.kv.allocator.check()


def test_another_budget_or_context_misses(peaky_loaded):
    engine = _engine(peaky_loaded, reuse=True)
    _generate(engine, CONTEXT, 1)
    other = CONTEXT[:-1] + [CONTEXT[-1] % 89 + 1]
    _generate(engine, other + QUESTIONS[0], 2)  # a different last context token: no hit
    assert engine.stats()["prefix_hit_tokens"] == 0
    cheaper = _engine(peaky_loaded, reuse=True, kv_policy_options={**OPTIONS, "budget": 0.25, "reuse": True})
    assert cheaper.policy.namespace() != engine.policy.namespace()  # the key names the method and budget


def test_compressed_contexts_give_way_when_blocks_run_short(peaky_loaded):
    block_bytes = _engine(peaky_loaded, reuse=True).kv.block_bytes
    engine = _engine(peaky_loaded, reuse=True, kv_cache_memory=26 * block_bytes)
    _generate(engine, CONTEXT, 1)
    assert engine.kv.compressed.match(None, CONTEXT + [1]) is not None
    _generate(engine, QUESTIONS[0] * 40, 1)  # 160 tokens and their scoring pass: need the kept context's blocks
    assert engine.kv.compressed.match(None, CONTEXT + [1]) is None  # given way; the new prompt is kept instead
    s = engine.stats()
    assert s["compressed_prefixes"] == 1 and s["kv_blocks_used"] == s["compressed_prefix_blocks"] == 80 // 8
    engine.kv.allocator.check()


def test_reuse_refuses_formats_with_fp16_windows(peaky_loaded):
    with pytest.raises(ConfigError, match="fp16 windows"):
        _engine(peaky_loaded, reuse=True, kv_cache_dtype="int4", kv_cache_options={"group_size": 16})
