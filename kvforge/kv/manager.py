"""KVCacheManager: the facade the scheduler talks to, and the one owner of each request's KV state.

A request is anything with `request_id`, `token_ids`, `num_tokens`, `num_computed_tokens` and
`cache_salt` (the engine's Sequence). The manager reads those and never writes them: the scheduler
owns `num_computed_tokens`; block tables, prefix locks, evicted counts and policy state live here,
in one RequestKV per request id.
"""
from __future__ import annotations

import torch

from kvforge.kv.blocks import BlockAllocator
from kvforge.kv.layer_format import KVFormat
from kvforge.kv.memory import blocks_for_tokens, bytes_per_block
from kvforge.kv.pool import KVPool
from kvforge.kv.prefix import PrefixTree
from kvforge.kv.request_kv import RequestKV
from kvforge.kv.spec import KVCacheSpec
from kvforge.kv.tiers.hooks import TierHooks
from kvforge.kv.tiers.swap import SwapHooks

_EMPTY = RequestKV()


class KVCacheManager(TierHooks, SwapHooks):
    def __init__(self, spec: KVCacheSpec, fmt: KVFormat, num_blocks: int, block_size: int, device: torch.device,
                 layout: str = "paged", max_model_len: int = 4096, enable_prefix_caching: bool = False,
                 max_num_seqs: int = 1):
        self.spec, self.format, self.block_size, self.layout = spec, fmt, block_size, layout
        self.max_model_len = max_model_len
        self.pool = KVPool(spec, fmt, num_blocks, block_size, device, max_num_seqs)
        self.allocator = BlockAllocator(num_blocks)
        self.block_bytes = bytes_per_block(spec, fmt, block_size)
        self.prefix_tree = PrefixTree(self.allocator, block_size) if enable_prefix_caching and layout == "paged" else None
        self.requests: dict[str, RequestKV] = {}
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        self.peak_blocks_used = 0
        self.prefix_short_prompts = 0  # prompts of at most one block: nothing of them can ever be cached

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    # -- per-request state ----------------------------------------------------------------------

    def _state(self, req) -> RequestKV:
        state = self.requests.get(req.request_id)
        if state is None:
            state = self.requests[req.request_id] = RequestKV()
        return state

    def block_table(self, req) -> list[int]:
        return self.requests.get(req.request_id, _EMPTY).block_table

    def cache_len(self, req) -> int:
        """Slots req occupies in its block table: its computed tokens less those a KV policy dropped."""
        return req.num_computed_tokens - self.requests.get(req.request_id, _EMPTY).num_evicted

    def policy_state(self, req, new):
        """req's KV-policy statistics, made by `new()` on first use."""
        state = self._state(req)
        if state.policy_state is None:
            state.policy_state = new()
        return state.policy_state

    def slots(self, req, start: int, end: int) -> list[int]:
        bs, table = self.block_size, self.block_table(req)
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    # -- admission ------------------------------------------------------------------------------

    def match_prefix(self, req) -> int:
        """Adopt the longest cached prefix of a waiting request (whole blocks, at least one token left to
        compute); returns the tokens it now has computed. A request still holding an earlier match (it was
        held back) re-matches when the tree has grown since."""
        if self.is_swapped(req):
            return self._swap_in(req)
        if self.prefix_tree is None:
            held = self.requests.get(req.request_id)  # a swapped-in request holds its restored tokens
            return held.num_matched if held is not None else req.num_computed_tokens
        usable = (req.num_tokens - 1) // self.block_size * self.block_size
        held = self.requests.get(req.request_id)
        if held is not None:
            if self.prefix_tree.peek_prefix(req.token_ids[:usable], req.cache_salt) <= held.num_matched:
                return held.num_matched
            self.free(req, cache=False)
        match = self.prefix_tree.match_prefix(req.token_ids[:usable], salt=req.cache_salt)
        if match.num_tokens:
            self.prefix_tree.lock(match.node)
            self.allocator.incref(match.block_ids)
            state = self._state(req)
            state.prefix_node, state.num_matched = match.node, match.num_tokens
            state.block_table.extend(match.block_ids)
        if self.tiers is not None:
            self._load_from_tiers(req, usable, match.num_tokens)
        return match.num_tokens

    def record_admission(self, req) -> None:
        """Count the prefix-cache lookup of a request that was admitted (hits are its computed tokens)."""
        if self.prefix_tree is None:
            return
        self.prefix_queried_tokens += req.num_tokens
        self.prefix_hit_tokens += req.num_computed_tokens
        if req.num_tokens <= self.block_size:
            self.prefix_short_prompts += 1

    def uncached_head(self, req) -> tuple | None:
        """Key of the first block req must still compute, when that block could be shared (else None)."""
        if self.prefix_tree is None:
            return None
        start, bs = req.num_computed_tokens, self.block_size
        if req.num_tokens - start <= bs:
            return None
        return req.cache_salt, start, tuple(req.token_ids[start: start + bs]), tuple(req.token_ids[:start][-bs:])

    # -- blocks ---------------------------------------------------------------------------------

    def allocate_slots(self, req, num_new_tokens: int) -> bool:
        """Make room for num_new_tokens more tokens of req; False when the cache is full."""
        table = self.block_table(req)
        if self.layout == "contiguous" and not table:
            need = blocks_for_tokens(self.max_model_len, self.block_size)
        else:
            need = blocks_for_tokens(self.cache_len(req) + num_new_tokens, self.block_size) - len(table)
        if need <= 0:
            return True
        if not self.allocator.can_allocate(need) and self.prefix_tree is not None:
            self.prefix_tree.reclaim(need - self.allocator.num_free)
        if not self.allocator.can_allocate(need):
            return False
        self._state(req).block_table.extend(self.allocator.allocate(need))
        self.peak_blocks_used = max(self.peak_blocks_used, self.allocator.num_used)
        return True

    def cache_full_blocks(self, req) -> None:
        """Offer req's full computed blocks to the prefix tree so other requests can share them."""
        state = self.requests.get(req.request_id)
        if state is not None:
            self._cache_full_blocks(req, state)

    def _cache_full_blocks(self, req, state: RequestKV) -> None:
        full = req.num_computed_tokens // self.block_size
        if self.prefix_tree is None or full == 0:
            return
        tokens = req.token_ids[: full * self.block_size]
        _, node = self.prefix_tree.insert(tokens, state.block_table[:full], salt=req.cache_salt)
        self.prefix_tree.lock(node)
        if state.prefix_node is not None:
            self.prefix_tree.unlock(state.prefix_node)
        state.prefix_node = node

    def truncate(self, req, num_rows: int) -> None:
        """Keep req's first num_rows cache rows (the rest were dropped or rejected): blocks past them are freed."""
        state = self._state(req)
        kept = blocks_for_tokens(num_rows, self.block_size)
        self.allocator.decref(state.block_table[kept:])
        del state.block_table[kept:]

    def rollback(self, req) -> None:
        """req's num_computed_tokens moved back (rejected drafts): free blocks past its cache and tell the
        layers that rows past it in the last block are void (staged formats must not encode them)."""
        length = self.cache_len(req)
        self.truncate(req, length)
        if length % self.block_size:
            self.pool.forget_rows(self.block_table(req)[length // self.block_size], length % self.block_size)

    def record_evicted(self, req, num_tokens: int) -> None:
        self._state(req).num_evicted += num_tokens

    def free(self, req, cache: bool = True) -> None:
        """Release everything req holds; with `cache`, its computed full blocks stay in the prefix cache first."""
        self._drop_swapped(req)
        state = self.requests.pop(req.request_id, None)
        if state is None:
            return
        if cache:
            self._cache_full_blocks(req, state)
        self._cancel_load(state)
        if state.prefix_node is not None:
            self.prefix_tree.unlock(state.prefix_node)
        for table in state.block_tables:
            self.allocator.decref(table)

    def reset_prefix_cache(self) -> int:
        """Drop every cached block nobody is using; returns blocks freed."""
        if self.prefix_tree is None:
            return 0
        return self.prefix_tree.reclaim(self.allocator.num_blocks)

    def stats(self) -> dict:
        used = self.allocator.num_used
        tree = self.prefix_tree
        return {
            "kv_blocks_total": self.allocator.num_blocks,
            "kv_blocks_used": used,
            "kv_blocks_used_peak": self.peak_blocks_used,
            "kv_blocks_free": self.allocator.num_free,
            "kv_blocks_cached_idle": tree.reclaimable_blocks() if tree is not None else 0,
            "kv_block_size": self.block_size,
            "kv_bytes_per_block": self.block_bytes,
            "kv_bytes_total": self.allocator.num_blocks * self.block_bytes,
            "kv_bytes_used": used * self.block_bytes,
            "kv_usage": used / max(1, self.allocator.num_blocks),
            "prefix_queried_tokens": self.prefix_queried_tokens,
            "prefix_hit_tokens": self.prefix_hit_tokens,
            "prefix_hit_rate": self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0,
            "prefix_reclaimed_blocks": tree.reclaimed_blocks if tree is not None else 0,
            "prefix_cache_granularity_tokens": self.block_size,
            "prefix_short_prompts": self.prefix_short_prompts,
            **self.tier_stats(),
            **(self.swap_stats() if self.tiers is not None else {}),
        }
