"""Swap-out / swap-in cycles through a slow disk tier leave no file behind: each swap-in's discard runs after the
store of its blocks, even when that store is still being written."""
from __future__ import annotations

import os
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
