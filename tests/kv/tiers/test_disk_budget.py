"""Disk tier budget: files that are not the tier's are never counted, evicted or deleted; the budget holds at every
write, across a restart (a smaller budget trims at open) and for several tiers (processes) on one directory."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from kvforge.kv.tiers.disk import SUFFIX, DiskTier
from kvforge.kv.tiers.entry import pack
from kvforge.kv.tiers.keys import BlockKey

DESC = "fp32 {} block_size=8"
PAYLOAD = 150
ENTRY = len(pack(BlockKey(0, bytes(16)), bytes(PAYLOAD), DESC))
BUDGET = 4 * ENTRY + ENTRY // 2  # room for four entries
TIER_FILE = re.compile(r"\d+-[0-9a-f]{32}\.kvb(\.\d+\.\d+\.tmp)?")  # an entry, or one being written


def key(i: int) -> BlockKey:
    return BlockKey(0, i.to_bytes(16, "little"))


def items(start: int, n: int) -> list[tuple[BlockKey, bytes]]:
    return [(key(i), bytes([i % 256]) * PAYLOAD) for i in range(start, start + n)]


def tier_bytes(directory) -> int:
    """Bytes of the tier's own files (finished or being written) in the directory."""
    return sum(os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory) if TIER_FILE.fullmatch(n))


def test_foreign_files_are_never_counted_evicted_or_deleted(tmp_path):
    foreign = {"backup-2024.kvb": b"x" * 802, "0-abc.kvb": b"y" * 10, "notes.txt": b"z" * 5000,
               "other.kvb.1.2.tmp": b"w" * 7}
    for name, data in foreign.items():
        (tmp_path / name).write_bytes(data)
    tier = DiskTier(str(tmp_path), BUDGET, DESC)
    assert tier.used_bytes() == 0
    for start in range(0, 12, 3):
        tier.put(items(start, 3))
        assert tier_bytes(tmp_path) == tier.used_bytes() <= BUDGET
    assert tier.contains([key(i) for i in range(12)]) == [False] * 8 + [True] * 4
    assert {n: (tmp_path / n).read_bytes() for n in foreign} == foreign
    assert DiskTier(str(tmp_path), BUDGET, DESC).used_bytes() == 4 * ENTRY  # a restart counts only the tier's


def test_budget_holds_while_a_file_is_written(tmp_path, monkeypatch):
    """Room is made before a file is written, so the directory never holds more than the budget, even for the
    moment between a file's write and its rename."""
    tier = DiskTier(str(tmp_path), BUDGET, DESC)
    seen = []
    replace = os.replace

    def watched(src, dst):
        seen.append(tier_bytes(tmp_path))
        replace(src, dst)

    monkeypatch.setattr(os, "replace", watched)
    for start in range(0, 10, 2):
        tier.put(items(start, 2))
    assert len(seen) == 10 and max(seen) <= BUDGET


def test_restart_counts_what_is_there_and_trims_to_a_smaller_budget(tmp_path):
    DiskTier(str(tmp_path), 1 << 20, DESC).put(items(0, 8))
    again = DiskTier(str(tmp_path), BUDGET, DESC)
    assert again.used_bytes() == tier_bytes(tmp_path) == 4 * ENTRY
    assert again.contains([key(i) for i in range(8)]) == [False] * 4 + [True] * 4  # the oldest went


def test_two_tiers_on_one_directory_hold_one_budget_together(tmp_path):
    first, second = DiskTier(str(tmp_path), BUDGET, DESC), DiskTier(str(tmp_path), BUDGET, DESC)
    for start in range(0, 24, 2):
        (first if start % 4 else second).put(items(start, 2))
        assert tier_bytes(tmp_path) <= BUDGET
    assert first.used_bytes() <= BUDGET and second.get([key(23)]) == [bytes([23]) * PAYLOAD]
    assert second.contains([key(22), key(23)]) == [True, True]  # written by the other one, found after its rescan


WRITER = """
import os, sys, time
from kvforge.kv.tiers.disk import DiskTier
from kvforge.kv.tiers.keys import BlockKey
directory, budget, first, go = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
tier = DiskTier(directory, budget, {desc!r}, fsync=False)
open(go + str(first), "w").close()
while not os.path.exists(go):  # both writers start together
    time.sleep(0.001)
for i in range(first, first + 300):
    tier.put([(BlockKey(0, i.to_bytes(16, "little")), bytes([i % 256]) * {payload})])
"""


def test_processes_writing_at_once_stay_within_the_budget(tmp_path):
    directory, go = tmp_path / "tier", tmp_path / "go"
    script = WRITER.format(desc=DESC, payload=PAYLOAD)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", script, str(directory), str(BUDGET), str(10000 * w), str(go)],
                              env=env, cwd=tmp_path) for w in range(2)]
    deadline = time.monotonic() + 120
    while not all(os.path.exists(f"{go}{10000 * w}") for w in range(2)) and time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs)
        time.sleep(0.01)  # until both have imported and opened the tier
    go.touch()
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    assert 0 < tier_bytes(directory) <= BUDGET
    assert not [n for n in os.listdir(directory) if n.endswith(".tmp")]
    assert DiskTier(str(directory), BUDGET, DESC).used_bytes() == tier_bytes(directory)


def test_truncated_entry_found_at_restart_is_a_miss_and_removed(tmp_path):
    DiskTier(str(tmp_path), BUDGET, DESC).put(items(0, 2))
    path = tmp_path / (key(0).name + SUFFIX)
    path.write_bytes(Path(path).read_bytes()[:30])
    again = DiskTier(str(tmp_path), BUDGET, DESC)
    assert again.get([key(0), key(1)]) == [None, bytes([1]) * PAYLOAD]
    assert not path.exists() and again.used_bytes() == tier_bytes(tmp_path) == ENTRY
