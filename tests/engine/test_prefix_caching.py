"""Prefix sharing in the engine: same greedy outputs on and off, real reuse, salts, multi-turn."""
import pytest

from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
SYSTEM = [(11 * i) % 89 + 3 for i in range(27)]  # 27 tokens: ends mid-block with block_size 4


def run(engine, prompts, salts=None):
    salts = salts or [None] * len(prompts)
    ids = [engine.add_request(p, GREEDY, cache_salt=s) for p, s in zip(prompts, salts)]
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return [done[i] for i in ids]


def make(loaded, caching, **kw):
    options = {"kv_cache_memory": 1 << 22, "block_size": 4, "max_model_len": 128, "max_num_batched_tokens": 32, **kw}
    return LLMEngine(EngineConfig(enable_prefix_caching=caching, **options), loaded)


def shared_prompts():
    return [SYSTEM + [40 + i, 50 + i, 60 + (i * 7) % 20][: 1 + i % 3] for i in range(8)] + [SYSTEM[:13], SYSTEM]


@pytest.mark.parametrize("budget_blocks", [None, 30])
def test_same_outputs_on_and_off(tiny_loaded, budget_blocks):
    kw = {} if budget_blocks is None else {"kv_cache_memory": budget_blocks * 4 * 2 * 2 * 2 * 16 * 4, "max_model_len": 64}
    off = run(make(tiny_loaded, False, **kw), shared_prompts())
    on_engine = make(tiny_loaded, True, **kw)
    on = run(on_engine, shared_prompts())
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    stats = on_engine.stats()
    assert stats["prefix_hit_tokens"] >= 7 * 24  # the 24 whole-block tokens of SYSTEM, for most followers
    if budget_blocks:
        assert on_engine.scheduler.num_preemptions > 0 or stats["prefix_reclaimed_blocks"] > 0


def test_hit_confirms_tokens_and_respects_salt(tiny_loaded):
    engine = make(tiny_loaded, True)
    run(engine, [SYSTEM + [1]], salts=["tenant-a"])
    other = run(engine, [SYSTEM + [2]], salts=["tenant-b"])[0]
    assert other.metrics.cached_tokens == 0
    same = run(engine, [SYSTEM + [3]], salts=["tenant-a"])[0]
    assert same.metrics.cached_tokens == 24
    changed = list(SYSTEM)
    changed[10] += 1
    assert run(engine, [changed + [3]], salts=["tenant-a"])[0].metrics.cached_tokens == 8


def test_multi_turn_reuses_prompt_and_answer(tiny_loaded):
    engine = make(tiny_loaded, True)
    first = run(engine, [SYSTEM])[0]
    follow_up = SYSTEM + first.token_ids + [7, 8, 9]
    second = run(engine, [follow_up])[0]
    history = len(SYSTEM) + len(first.token_ids) - 1  # the last answer token was never fed through the model
    assert second.metrics.cached_tokens == history // 4 * 4


def test_short_prompts_are_reported(tiny_loaded):
    engine = make(tiny_loaded, True)
    run(engine, [[5, 6, 7], [5, 6, 7]])
    s = engine.stats()
    assert s["prefix_short_prompts"] == 2 and s["prefix_hit_tokens"] == 0
    assert s["prefix_cache_granularity_tokens"] == 4


def test_caching_off_holds_no_blocks(tiny_loaded):
    engine = make(tiny_loaded, False)
    run(engine, shared_prompts())
    assert engine.kv.allocator.num_free == engine.kv.num_blocks


def test_every_follower_gets_the_whole_shared_prefix(tiny_loaded):
    """Followers held back while the first request computes the prefix still get all of it afterwards."""
    outs = run(make(tiny_loaded, True), shared_prompts())
    usable = [(len(p) - 1) // 4 * 4 for p in shared_prompts()]
    assert [o.metrics.cached_tokens for o in outs] == [0] + [min(u, 24) for u in usable[1:]]


def test_held_back_request_rematches_blocks_computed_meanwhile(tiny_loaded):
    engine = make(tiny_loaded, True)
    run(engine, [SYSTEM[:8] + [1]])  # warm: 2 blocks of SYSTEM
    a, b = run(engine, [SYSTEM + [1], SYSTEM + [2]])
    assert a.metrics.cached_tokens == 8
    assert b.metrics.cached_tokens == 24  # held back at 8 cached while a computed blocks 3-6, then re-matched
