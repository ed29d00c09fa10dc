"""Disk tier: atomic files with checked headers; corrupt or truncated files are misses and removed;
blocks survive a restart (a new engine finds them); a full budget pushes the oldest files out."""
from __future__ import annotations

import os
from pathlib import Path

from tier_helpers import ask_each, ask_flushed, docs, engine, twice

from kvforge.kv.tiers.disk import LOCK_NAME, SUFFIX, DiskTier
from kvforge.kv.tiers.keys import BlockKey

DESC = "fp32 {} block_size=8"


def key(i: int) -> BlockKey:
    return BlockKey(0, bytes([i]) * 16)


def test_round_trip_and_budget(tmp_path):
    tier = DiskTier(str(tmp_path), 3 * 250, DESC)
    payloads = [bytes([i]) * 150 for i in range(4)]
    pushed = tier.put([(key(i), payloads[i]) for i in range(4)])
    assert pushed == [(key(0), payloads[0])]  # oldest out (with its payload, for the next tier)
    assert tier.contains([key(i) for i in range(4)]) == [False, True, True, True]
    assert tier.get([key(2), key(0)]) == [payloads[2], None]
    assert sorted(os.listdir(tmp_path)) == sorted([LOCK_NAME] + [key(i).name + SUFFIX for i in (1, 2, 3)])
    again = DiskTier(str(tmp_path), 3 * 250, DESC)  # a restart indexes what is there
    assert again.get([key(1)]) == [payloads[1]] and again.used_bytes() == tier.used_bytes()


def test_corrupt_truncated_and_foreign_files_are_misses_and_removed(tmp_path):
    tier = DiskTier(str(tmp_path), 1 << 20, DESC)
    tier.put([(key(i), bytes([i]) * 100) for i in range(3)])
    paths = [os.path.join(tmp_path, key(i).name + SUFFIX) for i in range(3)]
    data = Path(paths[0]).read_bytes()
    Path(paths[0]).write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # one flipped bit
    Path(paths[1]).write_bytes(data[:40])  # truncated
    assert tier.get([key(0), key(1), key(2)]) == [None, None, bytes([2]) * 100]
    assert not os.path.exists(paths[0]) and not os.path.exists(paths[1])
    assert tier.corrupt_files == 2 and tier.contains([key(0), key(1)]) == [False, False]
    other = DiskTier(str(tmp_path), 1 << 20, "int8 {} block_size=8")  # same key, another layout
    assert other.get([key(2)]) == [None]


def test_engine_restart_finds_blocks_on_disk(tiny_loaded, tmp_path):
    tiers = [f"disk:{tmp_path}:16MiB"]
    first = engine(tiny_loaded, tiers=tiers)
    reference = ask_each(first, docs())
    first.kv.reset_prefix_cache()  # every cached block leaves the pool, into the disk tier
    first.close()
    second = engine(tiny_loaded, tiers=tiers)
    again = ask_each(second, docs())
    assert [o.token_ids for o in again] == [o.token_ids for o in reference]
    assert [o.metrics.cached_tokens for o in again] == [32] * 4
    assert second.stats()["tier_disk_loaded_blocks"] == 16


def test_host_then_disk_demotes_and_outputs_match(tiny_loaded, tmp_path):
    off = twice(engine(tiny_loaded))
    e = engine(tiny_loaded, tiers=["host:8KiB", f"disk:{tmp_path}:16MiB"])
    on = ask_flushed(e, docs() + docs())
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    s = e.stats()
    assert s["tier_host_evicted_blocks"] > 0 and s["tier_disk_stored_blocks"] > 0
    assert s["tier_disk_loaded_blocks"] > 0 and s["tier_hit_tokens"] == 4 * 32
