"""Tier options: write-through stores a block once, when it is cached; disk files are fsynced (file, then
directory) unless turned off; host memory is pinned only for a CUDA pool on a machine that has CUDA."""
from __future__ import annotations

import os

import torch
from tier_helpers import BS, ask_each, docs, engine, twice

from kvforge.cli import build_parser
from kvforge.cli.common import engine_kwargs
from kvforge.kv.tiers.disk import DiskTier
from kvforge.kv.tiers.host import HostTier
from kvforge.kv.tiers.keys import BlockKey
from kvforge.kv.tiers.setup import pin_host_memory

BLOCKS_PER_DOC = 32 // BS


def test_write_through_stores_each_block_once_when_cached(tiny_loaded):
    e = engine(tiny_loaded, tiers=["host:64MiB"], kv_tier_write_through=True)
    ask_each(e, docs(1))
    e.tiers.flush()
    s = e.stats()
    assert s["tier_host_stored_blocks"] == BLOCKS_PER_DOC  # in the tier while still in the pool
    assert e.kv.allocator.num_used == e.kv.prefix_tree.cached_blocks == BLOCKS_PER_DOC

    off = twice(engine(tiny_loaded))
    e = engine(tiny_loaded, tiers=["host:64MiB"], kv_tier_write_through=True)
    on = twice(e)
    e.tiers.flush()
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert [o.metrics.cached_tokens for o in on[4:]] == [32] * 4
    s = e.stats()
    # each block once, when computed; reclaiming frees it, and blocks loaded back are not stored again
    assert s["tier_host_stored_blocks"] == 4 * BLOCKS_PER_DOC and s["tier_host_loaded_blocks"] == 4 * BLOCKS_PER_DOC
    e.kv.allocator.check()
    assert e.kv.allocator.num_used == e.kv.prefix_tree.cached_blocks


def test_write_back_stores_only_what_leaves_the_pool(tiny_loaded):
    e = engine(tiny_loaded, tiers=["host:64MiB"])
    ask_each(e, docs(1))
    e.tiers.flush()
    assert e.stats()["tier_host_stored_blocks"] == 0


def _count_fsyncs(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(fd), real(fd))[1])
    return calls


def test_disk_tier_fsyncs_each_file_and_the_directory(tmp_path, monkeypatch):
    calls = _count_fsyncs(monkeypatch)
    tier = DiskTier(str(tmp_path), 1 << 20, "desc")
    keys = [BlockKey(0, bytes([i]) * 16) for i in range(3)]
    tier.put([(k, bytes([i]) * 64) for i, k in enumerate(keys)])
    assert len(calls) == 3 + 1  # one per file before its rename, one for the directory after the batch
    assert tier.get(keys) == [bytes([i]) * 64 for i in range(3)]


def test_disk_tier_without_fsync(tmp_path, monkeypatch):
    calls = _count_fsyncs(monkeypatch)
    tier = DiskTier(str(tmp_path), 1 << 20, "desc", fsync=False)
    tier.put([(BlockKey(0, bytes(16)), b"x" * 64)])
    assert calls == [] and tier.get([BlockKey(0, bytes(16))]) == [b"x" * 64]


def test_pinned_host_memory_only_for_a_cuda_pool_with_cuda(monkeypatch):
    assert not pin_host_memory("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert pin_host_memory("cuda") and pin_host_memory(torch.device("cuda:0"))
    assert not pin_host_memory("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not pin_host_memory("cuda:0")


def test_cpu_host_tier_keeps_payloads_as_given(tiny_loaded):
    payload = b"abc" * 10
    tier = HostTier(1 << 10)
    tier.put([(BlockKey(0, bytes(16)), payload)])
    assert tier.get([BlockKey(0, bytes(16))])[0] is payload  # no copy, no pinning on CPU
    e = engine(tiny_loaded, tiers=["host:1MiB"])
    assert e.tiers.tiers[0].pin is False


def test_cli_flags_reach_the_engine_config():
    args = build_parser().parse_args(["generate", "hi", "--kv-tier", "host:1GiB", "--kv-tier-write-through",
                                      "--no-kv-tier-fsync"])
    kw = engine_kwargs(args)
    assert kw["kv_tier_write_through"] is True and kw["kv_tier_fsync"] is False
    kw = engine_kwargs(build_parser().parse_args(["generate", "hi"]))
    assert kw["kv_tier_write_through"] is None and kw["kv_tier_fsync"] is True  # by tier: shared ones write through
    kw = engine_kwargs(build_parser().parse_args(["generate", "hi", "--kv-tier-write-back"]))
    assert kw["kv_tier_write_through"] is False
