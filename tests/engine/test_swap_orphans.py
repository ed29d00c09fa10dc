"""Swap-out / swap-in cycles through a slow disk tier leave no file behind: each swap-in's discard runs after the
store of its blocks, even when that store is still being written; a swap-out the store queue has no room for
preempts by recompute instead."""
from __future__ import annotations

import os
import threading
import time

from test_swap_preemption import engine, run

from kvforge.kv.tiers.disk import SUFFIX, DiskTier


class SlowDisk(DiskTier):
    """A disk tier that takes its time over each write, so discards arrive while stores are in flight."""

    def put(self, items, private=frozenset()):
        time.sleep(0.002 * len(items))
        return super().put(items)


def test_swap_cycles_leave_no_file_on_disk(tiny_loaded, tmp_path):
    roomy = run(engine(tiny_loaded, 200))
    e = engine(tiny_loaded, 24, kv_tiers=[f"disk:{tmp_path}:64MiB"], preemption_mode="swap")
    made = e.tiers.tiers[0]
    e.tiers.tiers[0] = SlowDisk(str(tmp_path), made.capacity_bytes, made.description, fsync=False)
    made.close()
    assert run(e) == roomy
    e.tiers.flush()
    s = e.stats()
    assert s["swapped_out_blocks"] == s["swapped_in_blocks"] > 20 and s["swap_failures"] == 0
    assert [n for n in os.listdir(tmp_path) if n.endswith(SUFFIX)] == []
    assert e.tiers.tiers[0].used_bytes() == 0
    e.close()


def test_swap_out_falls_back_to_recompute_when_the_store_queue_is_full(tiny_loaded):
    roomy = run(engine(tiny_loaded, 200))
    e = engine(tiny_loaded, 24, kv_tiers=["host:16MiB"], preemption_mode="swap")
    stuck = threading.Event()
    host = e.tiers.tiers[0]
    real_put = host.put
    host.put = lambda items, private=frozenset(): stuck.wait(30) and real_put(items, private)  # the worker hangs
    e.tiers.max_queued_bytes = 1  # one batch at a time
    assert run(e) == roomy
    s = e.stats()
    assert s["tier_host_dropped_stores"] > 0 and s["preempted_tokens_recomputed"] > 0 and s["swap_failures"] == 0
    stuck.set()
    e.close()
    assert e.kv.allocator.num_free == e.kv.num_blocks and not e.kv.swapped
