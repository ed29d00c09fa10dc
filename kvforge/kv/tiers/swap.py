"""SwapHooks: swap preemption for the KVCacheManager (a mixin beside TierHooks).

swap_out exports every block of a preempted request (its exact rows, staged or compacted by a KV policy alike)
to the first tier under private keys and frees them; the request keeps its computed tokens, evicted count and
policy statistics. At admission, swap-in reserves blocks and fetches them on the load worker, like a tier
load; the request waits in the loading state and resumes bit-exact. If a block cannot be read back (the tier
pushed it out and nothing held it), the request starts over by recompute.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from kvforge.kv.memory import blocks_for_tokens
from kvforge.kv.tiers.hooks import PendingLoad
from kvforge.kv.tiers.keys import BlockKey


@dataclass
class SwappedKV:
    keys: list[BlockKey]
    num_computed: int
    num_evicted: int
    policy_state: Any


class SwapHooks:
    swapped_out_blocks = 0
    swapped_in_blocks = 0
    swap_failures = 0

    @property
    def swapped(self) -> dict[str, SwappedKV]:
        if "_swapped" not in self.__dict__:
            self._swapped = {}
        return self._swapped

    def is_swapped(self, req) -> bool:
        return req.request_id in self.swapped

    def can_swap_in(self, req) -> bool:
        """Room for the request's blocks and one more (its next token), idle prefix-cache blocks reclaimed for it;
        without that a swapped request could wait forever behind blocks nobody uses."""
        need = min(len(self.swapped[req.request_id].keys) + 1, self.allocator.num_blocks)
        if not self.allocator.can_allocate(need):
            self._reclaim(need - self.allocator.num_free)
        return self.allocator.can_allocate(need)

    def swap_out(self, req) -> bool:
        """Move req's blocks to the first tier and free them; False when there is nothing to swap to."""
        state = self.requests.get(req.request_id)
        if self.tiers is None or state is None or state.load is not None:
            return False
        table = state.block_table[:blocks_for_tokens(self.cache_len(req), self.block_size)]
        tag = uuid.uuid4().bytes
        keys = [BlockKey(0, bytes(a ^ b for a, b in zip(tag, i.to_bytes(16, "little")))) for i in range(len(table))]
        self.tiers.store(list(zip(keys, self.pool.export_blocks(table))))
        entry = SwappedKV(keys, req.num_computed_tokens, state.num_evicted, state.policy_state)
        self.free(req, cache=False)
        self.swapped[req.request_id] = entry
        self.swapped_out_blocks += len(keys)
        return True

    def _swap_in(self, req) -> int:
        """Reserve blocks for a swapped request and start fetching them; returns its computed tokens."""
        entry = self.swapped.pop(req.request_id)
        ids = self.allocator.allocate(len(entry.keys))
        state = self._state(req)
        state.num_evicted, state.policy_state, state.num_matched = entry.num_evicted, entry.policy_state, entry.num_computed
        where = self.tiers.lookup(entry.keys)  # None: nowhere, reads as a miss
        state.load = PendingLoad(self.tiers.fetch(entry.keys, where), ids, entry.num_computed, swap=entry.keys)
        return entry.num_computed

    def _finish_swap_in(self, state, load: PendingLoad, payloads: list) -> None:
        self.tiers.discard(load.swap)
        if any(p is None for p in payloads):
            self.swap_failures += 1
            self.allocator.decref(load.block_ids)
            state.num_matched = state.num_evicted = 0
            state.policy_state = None
            return
        state.block_table.extend(load.block_ids)
        cache_len = state.num_matched - state.num_evicted
        self._restage(state, [cache_len])  # its window as it was, before its staged blocks come in
        self.pool.import_blocks(load.block_ids, payloads)
        self.park(state)  # until it runs again: a running request's claim may take these entries first
        self.swapped_in_blocks += len(load.block_ids)

    def _drop_swapped(self, req) -> None:
        entry = self.swapped.pop(req.request_id, None)
        if entry is not None and self.tiers is not None:
            self.tiers.discard(entry.keys)

    def swap_stats(self) -> dict:
        return {"swapped_out_blocks": self.swapped_out_blocks, "swapped_in_blocks": self.swapped_in_blocks,
                "swap_failures": self.swap_failures, "swapped_requests": len(self.swapped)}
