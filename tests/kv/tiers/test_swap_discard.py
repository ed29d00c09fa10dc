"""Swap keys leave nothing behind: a discard runs after any store of the same key queued or in flight, and in
Redis a swap key carries a TTL in case its discard never comes."""
from __future__ import annotations

import redis
from tier_helpers import GatedHost

from kvforge.kv.tiers.chain import TierChain
from kvforge.kv.tiers.keys import BlockKey
from kvforge.kv.tiers.redis_tier import PRIVATE_TTL_S, RedisTier, redis_key

DESC = "fp32 {} block_size=8"


def test_discard_waits_for_the_store_in_flight():
    tier = GatedHost()
    chain = TierChain([tier], 8)
    k = BlockKey(0, bytes(16))
    chain.store([(k, b"x" * 64)])
    assert tier.entered.wait(30)  # the worker is writing it now
    chain.discard([k])
    tier.gate.set()
    chain.flush()
    assert tier.contains([k]) == [False] and len(tier) == 0
    chain.close()


def test_swap_keys_expire_in_redis(redis_url):
    tier = RedisTier(redis_url, DESC)
    shared, private = BlockKey(0, b"s" * 16), BlockKey(0, b"p" * 16)
    tier.put([(shared, b"a" * 32), (private, b"b" * 32)], private=frozenset([private]))
    raw = redis.Redis.from_url(redis_url)
    assert raw.ttl(redis_key(shared)) == -1  # shared prefixes stay until Redis's own eviction
    assert 0 < raw.ttl(redis_key(private)) <= PRIVATE_TTL_S
    tier.discard([shared, private])
