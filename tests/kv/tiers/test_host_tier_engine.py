"""Host tier under the prefix cache: same greedy outputs with tiers on and off for every format and MLA,
second asks served from the tier, every block accounted for."""
from __future__ import annotations

import pytest
from tier_helpers import BS, ask_each, docs, engine, twice

FORMATS = [("fp32", None), ("fp16", None), ("bf16", None), ("int8", None), ("fp8_e4m3", None),
           ("int4", {"group_size": 16}), ("kivi2", {"group_size": 16, "window": 8})]


def check_accounting(e) -> None:
    e.kv.allocator.check()
    e.kv.prefix_tree.check()
    assert e.kv.allocator.num_used == e.kv.prefix_tree.cached_blocks


@pytest.mark.parametrize("fmt,opts", FORMATS, ids=[f for f, _ in FORMATS])
def test_outputs_identical_with_host_tier(tiny_loaded, fmt, opts):
    off = twice(engine(tiny_loaded, fmt=fmt, opts=opts))
    e = engine(tiny_loaded, fmt=fmt, opts=opts, tiers=["host:64MiB"])
    on = twice(e)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert [o.metrics.cached_tokens for o in off[4:]] == [0] * 4  # the pool alone kept none of the documents
    assert [o.metrics.cached_tokens for o in on[4:]] == [32] * 4  # (34 - 1) // 8 whole blocks, all from the tier
    s = e.stats()
    assert s["tier_host_hit_tokens"] >= 4 * 32 and s["tier_hit_tokens"] == 4 * 32
    assert s["tier_host_loaded_blocks"] == 4 * 32 // BS and s["tier_host_failed_loads"] == 0
    check_accounting(e)


def test_mla_latent_rows_through_host_tier(tiny_mla_loaded):
    off = twice(engine(tiny_mla_loaded))
    e = engine(tiny_mla_loaded, tiers=["host:64MiB"])
    on = twice(e)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert [o.metrics.cached_tokens for o in on[4:]] == [32] * 4
    check_accounting(e)


def test_full_host_tier_keeps_the_most_recent_blocks(tiny_loaded):
    e = engine(tiny_loaded, tiers=["host:64MiB"])
    payload = len(e.kv.pool.export_blocks([0])[0])
    e = engine(tiny_loaded, tiers=[f"host:{payload * 4}"])  # room for 4 blocks: one of the four documents
    ask_each(e, docs() + docs()[::-1])
    s = e.stats()
    assert s["tier_host_used_bytes"] <= payload * 4
    assert s["tier_host_evicted_blocks"] > 0
    assert 0 < s["tier_hit_tokens"] < 4 * 32
