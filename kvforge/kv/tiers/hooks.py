"""TierHooks: the KVCacheManager's side of the tiers (a mixin, so manager.py stays one concept).

Reclaim -> store (write-back): blocks the prefix tree gives back are exported (on the engine thread, before they
can be reused) and queued for the tier chain's store worker. With `write_through` (as in SGLang HiCache) a block is
stored when it enters the prefix tree instead, so reclaiming it later only frees it. Admission -> load: after the pool's longest match,
the match continues block by block through the tiers; hit blocks get pool blocks at once, their bytes are
fetched by the chain's load worker, and the request waits (the scheduler's `loading` list) until
`finish_load` imports them and puts them in the prefix tree. It never runs on half-loaded K/V.
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass


@dataclass
class PendingLoad:
    future: Future  # -> list[bytes | None], one per block
    block_ids: list[int]  # pool blocks reserved for them (held by the request)
    matched: int  # tokens the request held from the pool before the load
    swap: list | None = None  # the private keys of a swap-in (kvforge.kv.tiers.swap); None: a prefix load


class TierHooks:
    tiers = None  # kvforge.kv.tiers.chain.TierChain, set by attach_tiers
    keys = None  # kvforge.kv.tiers.keys.KeySpace
    tier_hit_tokens = 0  # prompt tokens loaded from tiers (also counted in prefix_hit_tokens)
    write_through = False

    def attach_tiers(self, tiers, keys, write_through: bool = False) -> None:
        self.tiers, self.keys, self.write_through = tiers, keys, write_through
        if self.prefix_tree is not None and not write_through:
            self.prefix_tree.on_reclaim = self._store_reclaimed

    def _write_through(self, tokens: list[int], salt: str | None, block_ids: list[int], cached_tokens: int) -> None:
        """Store the blocks that just entered the prefix tree (those after its `cached_tokens`), with write-through."""
        first = cached_tokens // self.block_size
        if self.write_through and self.tiers is not None and first < len(block_ids):
            keys = self.keys.chain(tokens, salt)[first:len(block_ids)]
            self.tiers.store(list(zip(keys, self.pool.export_blocks(block_ids[first:]))))

    def _store_reclaimed(self, node) -> None:
        salt, tokens = self.prefix_tree.path(node)
        keys = self.keys.chain(tokens, salt)[-len(node.block_ids):]
        self.tiers.store(list(zip(keys, self.pool.export_blocks(node.block_ids))))

    # -- loads -----------------------------------------------------------------------------------

    def _load_from_tiers(self, req, usable: int, matched: int) -> None:
        """Start fetching the blocks after the pool's match of `matched` tokens that the tiers hold, in order."""
        keys = self.keys.chain(req.token_ids[:usable], req.cache_salt)[matched // self.block_size:]
        where = self.tiers.leading_run(keys) if keys else []
        if not where:
            return
        # fetch before reclaiming: the blocks reclaim stores must not push these out of their tier first
        fetch = self.tiers.fetch(keys[:len(where)], where)
        if not self.allocator.can_allocate(len(where)):
            self._reclaim(len(where) - self.allocator.num_free)
        n = min(len(where), self.allocator.num_free)
        if n:
            self._state(req).load = PendingLoad(fetch, self.allocator.allocate(n), matched)

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
        payloads = load.future.result()[:len(load.block_ids)]
        if load.swap is not None:
            self._finish_swap_in(state, load, payloads)
            return True
        good = next((i for i, p in enumerate(payloads) if p is None), len(payloads))
        self.allocator.decref(load.block_ids[good:])
        if not good:
            return True
        ids = load.block_ids[:good]
        self.pool.import_blocks(ids, payloads[:good])
        state.block_table.extend(ids)
        state.num_matched = state.num_adopted = load.matched + good * self.block_size
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
        return {**self.tiers.stats_dict(), "tier_hit_tokens": self.tier_hit_tokens}
