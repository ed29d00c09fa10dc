"""TierHooks: the KVCacheManager's side of the tiers (a mixin, so manager.py stays one concept).

Reclaim -> store (write-back): blocks the prefix tree gives back are exported (on the engine thread, before they
can be reused) and queued for the tier chain's store worker. Write-through tiers (as in SGLang HiCache; disk and Redis
by default, so other processes reuse a block at once) get a block when it enters the prefix tree instead; with no
write-back tier, reclaiming only frees it. Blocks move as `block_io` exports them: the pool's, or the pool's and a
draft model's (kvforge.kv.pool_pair). Admission -> load: after the pool's longest match, the match continues block
by block through the tiers. The engine thread looks up only tiers that answer from memory (pending stores, host, disk
index); when a remote tier (Redis) may be asked, the lookup runs on the chain's load worker with the load. The
request waits (the scheduler's `loading` list) until `finish_load` gives the blocks that came in pool blocks, imports
them and puts them in the prefix tree. It never runs on half-loaded K/V, and no step waits for a tier.
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass


@dataclass
class PendingLoad:
    future: Future  # -> list[bytes | None], one per block
    block_ids: list[int]  # pool blocks reserved for them (held by the request; a prefix load gets them at the end)
    matched: int  # tokens the request held from the pool before the load
    swap: list | None = None  # the private keys of a swap-in (kvforge.kv.tiers.swap); None: a prefix load


class TierHooks:
    tiers = None  # kvforge.kv.tiers.chain.TierChain, set by attach_tiers
    keys = None  # kvforge.kv.tiers.keys.KeySpace
    tier_hit_tokens = 0  # prompt tokens loaded from tiers (also counted in prefix_hit_tokens)
    tier_close = None  # what close wrote and left (kvforge.kv.tiers.persist)
    block_io = None  # exports and imports whole blocks: the pool, or kvforge.kv.pool_pair.PoolPair

    def attach_tiers(self, tiers, keys, block_io=None) -> None:
        self.tiers, self.keys, self.block_io = tiers, keys, block_io or self.pool
        if self.prefix_tree is not None and tiers.back_tiers:
            self.prefix_tree.on_reclaim = self._store_reclaimed

    def _write_through(self, tokens: list[int], salt: str | None, block_ids: list[int], cached_tokens: int) -> None:
        """Store the blocks that just entered the prefix tree (those after its `cached_tokens`) in write-through tiers."""
        first = cached_tokens // self.block_size
        if self.tiers is not None and self.tiers.through_tiers and first < len(block_ids):
            keys = self.keys.chain(tokens, salt)[first:len(block_ids)]
            self.tiers.store_through(list(zip(keys, self.block_io.export_blocks(block_ids[first:]))))

    def _store_reclaimed(self, node) -> None:
        salt, tokens = self.prefix_tree.path(node)
        keys = self.keys.chain(tokens, salt)[-len(node.block_ids):]
        self.tiers.store(list(zip(keys, self.block_io.export_blocks(node.block_ids))))

    # -- loads -----------------------------------------------------------------------------------

    def _load_from_tiers(self, req, usable: int, matched: int) -> None:
        """Start fetching the blocks after the pool's match of `matched` tokens that the tiers hold, in order."""
        keys = self.keys.chain(req.token_ids[:usable], req.cache_salt)[matched // self.block_size:]
        if not keys:
            return
        if self.tiers.lookup_may_hang():
            fetch = self.tiers.fetch_run(keys)  # the lookup may hang: it runs on the load worker
        else:
            where = self.tiers.leading_run(keys, local=True)
            if not where:
                return
            fetch = self.tiers.fetch(keys[:len(where)], where)
        self._state(req).load = PendingLoad(fetch, [], matched)

    def is_loading(self, req) -> bool:
        state = self.requests.get(req.request_id)
        return state is not None and state.load is not None

    def wait_for_load(self, req, timeout: float) -> None:
        state = self.requests.get(req.request_id)
        if state is not None and state.load is not None:
            try:
                state.load.future.exception(timeout=timeout)
            except TimeoutError:
                pass

    def finish_load(self, req) -> bool:
        """Import req's fetched blocks into the pool and the prefix tree once they are in; False while fetching.
        Blocks after the first one that could not be read are given back (the request recomputes them)."""
        state = self.requests[req.request_id]
        load = state.load
        if not load.future.done():
            return False
        state.load = None
        payloads = load.future.result()
        if load.swap is not None:
            self._finish_swap_in(state, load, payloads)
            return True
        good = next((i for i, p in enumerate(payloads) if p is None), len(payloads))
        if good and not self.allocator.can_allocate(good):
            self._reclaim(good - self.allocator.num_free)
        good = min(good, self.allocator.num_free)
        if not good:
            return True
        ids = self.allocator.allocate(good)
        self.peak_blocks_used = max(self.peak_blocks_used, self.allocator.num_used)
        self.block_io.import_blocks(ids, payloads[:good])
        state.block_table.extend(ids)
        state.num_matched = load.matched + good * self.block_size
        self.tier_hit_tokens += good * self.block_size
        _, node = self.prefix_tree.insert(req.token_ids[:state.num_matched], state.block_table, salt=req.cache_salt)
        self.prefix_tree.lock(node)
        if state.prefix_node is not None:
            self.prefix_tree.unlock(state.prefix_node)
        state.prefix_nodes[:1] = [node]  # tiers run with one KV group (the engine refuses more)
        return True

    def _cancel_load(self, state) -> None:
        if state.load is not None:
            self.allocator.decref(state.load.block_ids)
            if state.load.swap is not None:
                self.tiers.discard(state.load.swap)
            state.load = None

    def tier_stats(self) -> dict:
        if self.tiers is None:
            return {}
        return {**self.tiers.stats_dict(), "tier_hit_tokens": self.tier_hit_tokens, **(self.tier_close or {})}
