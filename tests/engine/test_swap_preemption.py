"""Swap preemption: a preempted sequence's blocks go to the host tier and come back bit-exact, so outputs equal
an unconstrained run, for plain, staged and evicting (KV policy) caches alike; nothing is recomputed."""
from __future__ import annotations

import pytest

from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.errors import ConfigError
from kvforge.kv.formats import get_format
from kvforge.kv.memory import pool_bytes
from kvforge.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
PROMPTS = [[(i * 13 + j * 5) % 90 + 3 for j in range(20)] for i in range(6)]


def engine(loaded, blocks, fmt="fp32", opts=None, **kw):
    spec = loaded.config.kv_cache_spec()
    memory = pool_bytes(spec, get_format(fmt, **(opts or {})), 4, blocks, 64)
    kw.setdefault("enable_prefix_caching", False)
    cfg = EngineConfig(kv_cache_memory=memory, block_size=4, max_model_len=64, max_num_seqs=64, max_num_batched_tokens=64,
                       kv_cache_dtype=fmt, kv_cache_options=opts, kv_staging_share=1.0, **kw)
    return LLMEngine(cfg, loaded)


def run(e):
    ids = [e.add_request(p, PARAMS) for p in PROMPTS]
    done = {}
    while e.has_unfinished_requests():
        done.update({o.request_id: o for o in e.step() if o.finished})
    return [done[i].token_ids for i in ids]


# max_num_seqs=64 (kv_staging_share=1.0: staging for all 64 however small the pool) gives kivi2 more staging
# entries than blocks in use, so no run flushes any and the staged rows themselves must survive the swap
CASES = [("fp32", None, {}), ("kivi2", {"group_size": 16, "window": 8, "sinks": 2}, {}),
         ("fp32", None, {"kv_policy": "window", "kv_policy_options": {"budget": 24, "slack": 5}})]


@pytest.mark.parametrize("fmt,opts,policy", CASES, ids=["fp32", "kivi2", "window-policy"])
def test_swap_gives_the_outputs_of_an_unconstrained_run(tiny_loaded, fmt, opts, policy):
    roomy = run(engine(tiny_loaded, 200, fmt, opts, **policy))
    e = engine(tiny_loaded, 24, fmt, opts, kv_tiers=["host:16MiB"], preemption_mode="swap", **policy)
    assert run(e) == roomy
    s = e.stats()
    assert s["preemptions"] > 0 and s["preempted_tokens_recomputed"] == 0
    assert s["swapped_in_blocks"] == s["swapped_out_blocks"] > 0 and s["swap_failures"] == 0
    assert s["swapped_requests"] == 0 and e.kv.allocator.num_free == e.kv.num_blocks
    e.tiers.flush()
    assert s["tier_host_used_bytes"] == 0 or e.tiers.tiers[0].used_bytes() == 0  # swapped blocks are discarded


def test_swap_is_the_default_under_an_evicting_policy_with_a_host_tier(tiny_loaded):
    policy = {"kv_policy": "window", "kv_policy_options": {"budget": 24, "slack": 5}}
    assert engine(tiny_loaded, 24, kv_tiers=["host:1MiB"], **policy).preemption_mode == "swap"
    assert engine(tiny_loaded, 24, **policy).preemption_mode == "recompute"
    assert engine(tiny_loaded, 24, kv_tiers=["host:1MiB"]).preemption_mode == "recompute"
    with pytest.raises(ConfigError, match="needs a KV tier"):
        engine(tiny_loaded, 24, preemption_mode="swap")


def test_swapped_blocks_lost_fall_back_to_recompute(tiny_loaded):
    roomy = run(engine(tiny_loaded, 200))
    e = engine(tiny_loaded, 24, kv_tiers=["host:1KiB"], preemption_mode="swap")  # too small to hold a block
    assert run(e) == roomy
    s = e.stats()
    assert s["preemptions"] > 0 and s["swap_failures"] > 0 and e.kv.allocator.num_free == e.kv.num_blocks


def test_swapped_request_reclaims_idle_prefix_blocks_to_come_back(tiny_loaded):
    """Idle prefix-cache blocks must not keep a swapped request out forever (they are reclaimed for it)."""
    from kvforge.engine.scheduler import ScheduledBatch

    e = engine(tiny_loaded, 24, kv_tiers=["host:1MiB"], preemption_mode="swap", enable_prefix_caching=True)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    rid = e.add_request([(j * 7) % 90 + 3 for j in range(40)], params)  # 10 blocks
    e.step()
    seq = e.requests[rid]
    e.scheduler.running.remove(seq)
    e.scheduler._preempt(seq, ScheduledBatch())  # swapped out: the pool is empty again
    assert e.kv.is_swapped(seq)
    e.scheduler.waiting.remove(seq)
    other = e.add_request([(j * 11) % 90 + 3 for j in range(56)], params)  # leaves 14 idle blocks in the tree
    while e.has_unfinished_requests():
        e.step()
    assert e.kv.allocator.num_free < 11 and e.requests.get(other) is None
    e.scheduler.waiting.append(seq)
    for _ in range(50):
        if not e.has_unfinished_requests():
            break
        e.step()
    assert not e.has_unfinished_requests() and e.kv.connector.swap.swapped_in_blocks == 10


def test_swap_moves_the_draft_models_kv_too(tiny_loaded, tiny_dir):
    """Draft = target accepts every draft, unless a swapped-in block lacks the draft's K/V."""
    spec = {"method": "draft", "model": tiny_dir, "num_speculative_tokens": 3}
    roomy = run(engine(tiny_loaded, 200))
    e = engine(tiny_loaded, 52, kv_tiers=["host:16MiB"], preemption_mode="swap", speculative=spec)  # 26 shared blocks
    assert run(e) == roomy
    s = e.stats()
    assert s["swapped_in_blocks"] == s["swapped_out_blocks"] > 0 and s["swap_failures"] == 0
    assert s["spec_num_draft_tokens"] > 0 and s["spec_num_accepted_tokens"] == s["spec_num_draft_tokens"]
