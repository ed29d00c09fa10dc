"""Redis tier on a real redis-server: batched round trips, checked entries, a killed server loses nothing and
returns no wrong K/V, and a second engine process reuses the prefixes the first one computed."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import redis
from tier_helpers import ask_each, docs, engine, twice

from kvforge.kv.tiers.keys import BlockKey
from kvforge.kv.tiers.redis_tier import RedisTier, redis_key

DESC = "fp32 {} block_size=8"
HERE = os.path.dirname(__file__)


def test_round_trip_and_corrupt_entry(redis_url):
    tier = RedisTier(redis_url, DESC)
    keys = [BlockKey(1, bytes([i]) * 16) for i in range(3)]
    tier.put([(k, bytes([i]) * 64) for i, k in enumerate(keys[:2])])
    assert tier.contains(keys) == [True, True, False]
    assert tier.get(keys) == [bytes([0]) * 64, bytes([1]) * 64, None]
    raw = redis.Redis.from_url(redis_url)
    value = raw.get(redis_key(keys[0]))
    raw.set(redis_key(keys[0]), value[:-3])  # truncated behind our back
    raw.set(redis_key(keys[1]), value)  # another key's entry under this key
    assert tier.get(keys[:2]) == [None, None]
    assert tier.corrupt_entries == 2 and tier.contains(keys[:2]) == [False, False]


def test_outputs_identical_through_redis(tiny_loaded, redis_url):
    off = twice(engine(tiny_loaded))
    e = engine(tiny_loaded, tiers=[redis_url])
    on = ask_each(e, docs(), salt="identical") + ask_each(e, docs(), salt="identical")
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    s = e.stats()
    assert s["tier_redis_loaded_blocks"] == 16 and s["tier_hit_tokens"] == 4 * 32
    e.close()


def test_killed_redis_loses_no_request(tiny_loaded, private_redis):
    reference = twice(engine(tiny_loaded))
    e = engine(tiny_loaded, tiers=["host:4KiB", private_redis.url])  # host holds ~1 block: most go to Redis
    first = ask_each(e, docs())
    e.tiers.flush()
    private_redis.stop()  # killed mid-run: its blocks are gone, every call to it fails
    second = ask_each(e, docs())
    assert [o.token_ids for o in first + second] == [o.token_ids for o in reference]
    assert all(o.finish_reason == "length" for o in first + second)
    s = e.stats()
    assert s["tier_redis_failed_loads"] > 0 and s["tier_redis_failed_stores"] > 0
    assert s["tier_hit_tokens"] < 4 * 32  # what Redis held is recomputed
    e.kv.allocator.check()
    e.close()


def test_second_engine_process_reuses_prefixes(tiny_loaded, tiny_dir, redis_url):
    script = os.path.join(HERE, "share_prefixes.py")
    path = os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])  # the kvforge under test, not an installed one
    done = subprocess.run([sys.executable, script, tiny_dir, redis_url], capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"})
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    e = engine(tiny_loaded, tiers=[redis_url])
    ours = ask_each(e, docs(), salt="shared")
    assert [o.token_ids for o in ours] == theirs
    assert [o.metrics.cached_tokens for o in ours] == [32] * 4
    assert e.stats()["tier_redis_loaded_blocks"] == 16
    e.close()
