"""KVCacheManager: the facade the scheduler talks to, and the one owner of each request's KV state.

A request is anything with `request_id`, `token_ids`, `num_tokens`, `num_computed_tokens` and
`cache_salt` (the engine's Sequence). The manager reads those and never writes them: the scheduler
owns `num_computed_tokens`; block tables, prefix locks, evicted counts and policy state live here,
in one RequestKV per request id. KV that moves to and from anything else (tiers, swap) goes through
`self.connector` (kvforge.kv.connector), called at admission, caching, reclaim, free, preemption and close.
"""
from __future__ import annotations

import weakref

import torch

from kvforge.kv.blocks import BlockAllocator
from kvforge.kv.compressed_contexts import CompressedContexts
from kvforge.kv.compressed_prefixes import CompressedPrefixes
from kvforge.kv.connector import KVConnector
from kvforge.kv.groups import NULL_BLOCK, KVGroup, StateGroup
from kvforge.kv.layer_format import KVFormat
from kvforge.kv.memory import blocks_for_tokens, bytes_per_block
from kvforge.kv.pool import KVPool
from kvforge.kv.prefix import PrefixTree
from kvforge.kv.recurrent_states import RecurrentStates
from kvforge.kv.request_kv import RequestKV
from kvforge.kv.sliding_prefix import SlidingPrefixTree
from kvforge.kv.spec import KVCacheSpec
from kvforge.kv.staging import StagingWindows
from kvforge.kv.transfers import ConnectorTransfers

_EMPTY = RequestKV()


class KVCacheManager(StagingWindows, RecurrentStates, CompressedContexts):
    def __init__(self, spec: KVCacheSpec, fmt: KVFormat, num_blocks: int, block_size: int, device: torch.device,
                 layout: str = "paged", max_model_len: int = 4096, enable_prefix_caching: bool = False,
                 max_num_seqs: int = 1, groups: list[KVGroup] | None = None,
                 state_groups: list[StateGroup] | None = None, state_checkpoint_memory: int = 0,
                 state_checkpoint_interval: int = 1):
        self.spec, self.format, self.block_size, self.layout = spec, fmt, block_size, layout
        self.max_model_len = max_model_len
        self.groups = groups or [KVGroup(tuple(range(spec.num_layers)), None)]
        self.group_of_layer = {layer: g for g, group in enumerate(self.groups) for layer in group.layers}
        self.pool = KVPool(spec, fmt, num_blocks, block_size, device, max_num_seqs, self.groups)
        self._init_states(state_groups or [], max_num_seqs, device, enable_prefix_caching and layout == "paged",
                          state_checkpoint_memory, state_checkpoint_interval)
        self.staging_pools = [self.pool]  # pools whose layers follow the requests' fp16 windows (kv/staging.py)
        self.allocator = BlockAllocator(num_blocks)
        self.block_bytes = bytes_per_block(spec, fmt, block_size, self.groups)
        caching = enable_prefix_caching and layout == "paged"
        # one tree per group: the same token keys, each group's own blocks
        self.prefix_trees = [SlidingPrefixTree(self.allocator, block_size, g) if g.sliding
                             else PrefixTree(self.allocator, block_size) for g in self.groups] if caching else []
        self.prefix_tree = self.prefix_trees[0] if caching else None
        self.requests: dict[str, RequestKV] = {}
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        self.peak_blocks_used = 0
        self.prefix_short_prompts = 0  # prompts of at most one block: nothing of them can ever be cached
        self.connector: KVConnector | None = None  # moves blocks to and from tiers (attach_connector)
        self.compressed: CompressedPrefixes | None = None  # compressed contexts for later prompts (keep_compressed)
        self.transfers = ConnectorTransfers(weakref.proxy(self))  # no cycle: the pool goes when the manager does

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    # -- per-request state ----------------------------------------------------------------------

    def _state(self, req) -> RequestKV:
        state = self.requests.get(req.request_id)
        if state is None:
            state = self.requests[req.request_id] = RequestKV([[] for _ in self.groups])
        return state

    def block_table(self, req, group: int = 0) -> list[int]:
        """req's block table in `group` (a sliding group's starts with NULL_BLOCK placeholders)."""
        state = self.requests.get(req.request_id)
        return state.block_tables[group] if state is not None else []

    def cache_len(self, req) -> int:
        """Slots req occupies in a full-attention block table: its computed tokens less those a KV policy dropped."""
        return req.num_computed_tokens - self.requests.get(req.request_id, _EMPTY).num_evicted

    def group_cache_len(self, req, group: int) -> int:
        """Slots req occupies in `group`'s table (KV policies drop tokens from full-attention groups only)."""
        return req.num_computed_tokens if self.groups[group].sliding else self.cache_len(req)

    @property
    def full_groups(self) -> list[int]:
        return [g for g, group in enumerate(self.groups) if not group.sliding]

    def policy_state(self, req, new):
        """req's KV-policy statistics, made by `new()` on first use."""
        state = self._state(req)
        if state.policy_state is None:
            state.policy_state = new()
        return state.policy_state

    def slots(self, req, start: int, end: int, group: int = 0) -> list[int]:
        bs, table = self.block_size, self.block_table(req, group)
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    # -- admission ------------------------------------------------------------------------------

    def match_prefix(self, req) -> int:
        """Adopt the longest cached prefix of a waiting request (whole blocks, at least one token left to
        compute); returns the tokens it now has computed. A request still holding an earlier match (it was
        held back) re-matches when the tree has grown since."""
        if self.is_swapped(req):
            return self.transfers.swap_in(req)
        if self.compressed is not None and req.request_id not in self.requests:
            return self._match_compressed(req)
        if self.prefix_tree is None:
            held = self.requests.get(req.request_id)  # a swapped-in request holds its restored tokens
            return held.num_matched if held is not None else req.num_computed_tokens
        tokens = self._usable_tokens(req)
        usable = len(tokens)
        held = self.requests.get(req.request_id)
        if held is not None:
            if self._peek(tokens, req.cache_salt) <= held.num_matched:
                return held.num_matched
            self.free(req, cache=False)
        num = self._peek(tokens, req.cache_salt)
        count = held is None  # a first match: its shortfall of checkpoints is counted (after the tiers, with them)
        if num and self.state_pool is not None:
            num = self._resume_state(req, tokens, num, count=count and self.connector is None)
        if num:
            state = self._state(req)
            matches = [tree.match_prefix(tokens[:num], salt=req.cache_salt) for tree in self.prefix_trees]
            for tree, match in zip(self.prefix_trees, matches):
                tree.lock(match.node)  # all before adopting: a copy's allocation may reclaim unlocked blocks
            for g, (group, match) in enumerate(zip(self.groups, matches)):
                skip = group.first_needed_block(num, self.block_size)  # a sliding group adopts only its window
                state.block_tables[g].extend([NULL_BLOCK] * skip + self._adopt(match.block_ids[skip:]))
                state.prefix_nodes.append(match.node)
            state.num_matched = state.num_adopted = num
        if self.connector is not None and self.state_pool is not None:
            self.transfers.start_state_load(req, usable, num, count)
        elif self.connector is not None:
            self.transfers.start_load(req, usable, num)
        return num

    def cached_prefix(self, req) -> int:
        """About how many leading tokens of a waiting request the prefix tree holds now: a look that adopts and
        touches nothing (a recurrent model's checkpoints and compressed prefixes are not consulted)."""
        if self.prefix_tree is None:
            return 0
        tokens = self._usable_tokens(req)
        return min(tree.peek_prefix(tokens, req.cache_salt) for tree in self.prefix_trees)

    def _usable_tokens(self, req) -> list[int]:
        """req's tokens a prefix match may cover: whole blocks, at least one token left to compute."""
        return req.token_ids[:(req.num_tokens - 1) // self.block_size * self.block_size]

    def _peek(self, tokens, salt) -> int:
        """Tokens cached in every group: all full-attention blocks, and each sliding group's blocks of the
        last window before the hit point; a recurrent model's, only as far as its deepest state checkpoint."""
        num = min(tree.peek_prefix(tokens, salt) for tree in self.prefix_trees)
        if self.state_pool is not None:
            return self._deepest_checkpoint(tokens, salt, num)
        while True:
            usable = min([num] + [t.usable_prefix(tokens[:num], salt) for t in self.prefix_trees
                                  if isinstance(t, SlidingPrefixTree)])
            if usable == num:
                return num
            num = usable

    def record_admission(self, req) -> None:
        """Count the prefix-cache lookup of a request that was admitted (hits are its computed tokens)."""
        if self.prefix_tree is None and self.compressed is None:
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

    def allocate_slots(self, req, num_new_tokens: int, prompt_window: bool = True) -> bool:
        """Make room for num_new_tokens more tokens of req in every group; False when the cache is full.
        Sliding groups first give back the blocks wholly behind their window. A staged format's fp16 window is
        counted from the end of req's known tokens (`prompt_window`) or from the end of these new ones."""
        state = self.requests.get(req.request_id)
        if self.layout == "contiguous" and (state is None or not state.block_table):
            needs = [blocks_for_tokens(self.max_model_len, self.block_size)] * len(self.groups)
        else:
            if state is not None:
                self._free_behind_windows(req, state)
            needs = [blocks_for_tokens(self.group_cache_len(req, g) + num_new_tokens, self.block_size)
                     - len(self.block_table(req, g)) for g in range(len(self.groups))]
        need = sum(max(0, n) for n in needs)
        if need > 0 and not self.make_room(need):
            return False
        needs_state = self.state_pool is not None and (state is None or state.state_slot is None)
        if needs_state and self.state_pool.num_free == 0:
            return False
        state = self._state(req)
        if needs_state:
            state.state_slot = self.state_pool.allocate()
        for table, n in zip(state.block_tables, needs):
            if n > 0:
                table.extend(self.allocator.allocate(n))
        self.peak_blocks_used = max(self.peak_blocks_used, self.allocator.num_used)
        starts = [self.group_cache_len(req, g) for g in range(len(self.groups))]
        known = req.num_tokens - req.num_computed_tokens if prompt_window else num_new_tokens
        self._restage(state, [c + num_new_tokens for c in starts], starts, [c + known for c in starts])
        self._repin(state)
        return True

    def _free_behind_windows(self, req, state: RequestKV) -> None:
        """Replace a sliding group's blocks that no query from req.num_computed_tokens on can see by placeholders."""
        if self.layout != "paged":
            return
        for group, table in zip(self.groups, state.block_tables):
            j = min(group.first_needed_block(req.num_computed_tokens, self.block_size), len(table)) - 1
            while j >= 0 and table[j] != NULL_BLOCK:
                self.allocator.decref([table[j]])
                table[j] = NULL_BLOCK
                j -= 1

    def make_room(self, num_blocks: int) -> bool:
        """Whether num_blocks blocks can be allocated, idle cached blocks reclaimed for them where needed."""
        if not self.allocator.can_allocate(num_blocks):
            self._reclaim(num_blocks - self.allocator.num_free)
        return self.allocator.can_allocate(num_blocks)

    def _reclaim(self, num_blocks: int) -> int:
        freed = 0  # sliding trees first: what they drop lies behind some window
        for tree in sorted(self.prefix_trees, key=lambda t: not isinstance(t, SlidingPrefixTree)):
            if freed >= num_blocks:
                break
            freed += tree.reclaim(num_blocks - freed)
        if self.compressed is not None and freed < num_blocks:
            freed += self.compressed.reclaim(num_blocks - freed)
        return freed

    def cache_full_blocks(self, req) -> None:
        """Offer req's full computed blocks to the prefix tree so other requests can share them."""
        state = self.requests.get(req.request_id)
        if state is not None:
            self._cache_full_blocks(req, state)

    def _cache_full_blocks(self, req, state: RequestKV) -> None:
        full = req.num_computed_tokens // self.block_size
        if not self.prefix_trees or full == 0:
            return
        tokens = req.token_ids[: full * self.block_size]
        if not state.prefix_nodes:
            state.prefix_nodes = [None] * len(self.groups)
        for g, (tree, table) in enumerate(zip(self.prefix_trees, state.block_tables)):
            cached, node = tree.insert(tokens, table[:full], salt=req.cache_salt)
            if g == 0 and self.connector is not None:
                self.connector.on_cached(tokens, req.cache_salt, table[:full], cached)
            tree.lock(node)
            if state.prefix_nodes[g] is not None:
                tree.unlock(state.prefix_nodes[g])
            state.prefix_nodes[g] = node

    def truncate(self, req, num_rows: int) -> None:
        """Keep req's first num_rows cache rows in the full-attention groups (a KV policy dropped the rest):
        blocks past them are freed."""
        state = self._state(req)
        for g in self.full_groups:
            self._truncate_table(state.block_tables[g], num_rows)
        self._restage(state, [num_rows if not group.sliding else req.num_computed_tokens for group in self.groups])

    def _truncate_table(self, table: list[int], num_rows: int) -> None:
        kept = blocks_for_tokens(num_rows, self.block_size)
        self.allocator.decref([b for b in table[kept:] if b != NULL_BLOCK])
        del table[kept:]

    def rollback(self, req) -> None:
        """req's num_computed_tokens moved back (rejected drafts): free blocks past its cache and tell the
        layers that rows past it in the last block are void (staged formats must not encode them)."""
        state = self._state(req)
        for g, table in enumerate(state.block_tables):
            length = self.group_cache_len(req, g)
            self._truncate_table(table, length)
            if length % self.block_size:
                self.pool.forget_rows(table[length // self.block_size], length % self.block_size)
        self._restage(state, [self.group_cache_len(req, g) for g in range(len(self.groups))])

    def record_evicted(self, req, num_tokens: int) -> None:
        self._state(req).num_evicted += num_tokens

    def free(self, req, cache: bool = True) -> None:
        """Release everything req holds; with `cache`, its computed full blocks stay in the prefix cache first."""
        if self.connector is not None:
            self.connector.request_finished(req.request_id)
        self.release(req, cache)

    def release(self, req, cache: bool) -> None:
        """`free` without telling the connector (it holds what was swapped out)."""
        state = self.requests.pop(req.request_id, None)
        if state is None:
            return
        if cache and state.load is None:  # a transfer in flight: its blocks hold nothing yet (a swap-in's are apart)
            self._cache_full_blocks(req, state)
        self.transfers.cancel(state)
        for tree, node in zip(self.prefix_trees, state.prefix_nodes):
            if node is not None:
                tree.unlock(node)
        for table in state.block_tables:
            self.allocator.decref([b for b in table if b != NULL_BLOCK])
        if state.state_slot is not None:
            self.state_pool.free(state.state_slot)
        self._unstage_all(state)

    # -- KV connector: it moves the bytes, the manager keeps the blocks ---------------------------------

    def attach_connector(self, connector: KVConnector) -> None:
        self.connector = connector
        self._attach_checkpoint_tiers()
        if self.compressed is not None:
            self.transfers.attach_compressed()
        if self.prefix_tree is not None and connector.stores_reclaimed:
            manager = weakref.proxy(self)  # the tree is the manager's: no cycle back to it
            self.prefix_tree.on_reclaim = lambda node: manager._store_reclaimed(node)

    def _store_reclaimed(self, node) -> None:
        salt, tokens = self.prefix_tree.path(node)
        self.connector.on_reclaimed(tokens, salt, node.block_ids)

    # the scheduler's questions: may a request run (loading), swap out / in (kvforge.kv.transfers)
    def is_loading(self, req) -> bool:
        return self.transfers.is_loading(req)

    def wait_for_load(self, req, timeout: float) -> None:
        self.transfers.wait_for_load(req, timeout)

    def finish_load(self, req) -> bool:
        return self.transfers.finish_load(req)

    def is_swapped(self, req) -> bool:
        return self.connector is not None and self.connector.is_swapped(req.request_id)

    @property
    def swapped(self) -> list[str]:
        """Ids of the requests swapped out."""
        return self.connector.swapped_requests() if self.connector is not None else []

    def can_swap_in(self, req) -> bool:
        return self.transfers.can_swap_in(req)

    def swap_out(self, req) -> bool:
        return self.transfers.swap_out(req)

    def close(self, timeout: float) -> None:
        """Let the connector keep what a restart should find (e.g. cached blocks written to shared tiers)."""
        if self.connector is not None:
            self.connector.close(self.prefix_tree, timeout)

    def reset_prefix_cache(self) -> int:
        """Drop every cached block nobody is using (and every state checkpoint; write-back tiers get both);
        returns blocks freed."""
        if self.checkpoints is not None:
            self.checkpoints.drop_lru(len(self.checkpoints))
        return self._reclaim(self.allocator.num_blocks)

    def stats(self) -> dict:
        used = self.allocator.num_used
        trees = self.prefix_trees
        return {
            "kv_blocks_total": self.allocator.num_blocks,
            "kv_blocks_used": used,
            "kv_blocks_used_peak": self.peak_blocks_used,
            "kv_blocks_free": self.allocator.num_free,
            "kv_blocks_cached_idle": sum(t.reclaimable_blocks() for t in trees),
            "kv_request_states": len(self.requests),
            "prefix_tree_nodes": sum(t.num_nodes() for t in trees),
            "kv_groups": len(self.groups),
            "kv_sliding_groups": len(self.groups) - len(self.full_groups),
            "kv_block_size": self.block_size,
            "kv_bytes_per_block": self.block_bytes,
            "kv_bytes_total": self.allocator.num_blocks * self.block_bytes,
            "kv_bytes_used": used * self.block_bytes,
            "kv_usage": used / max(1, self.allocator.num_blocks),
            "prefix_queried_tokens": self.prefix_queried_tokens,
            "prefix_hit_tokens": self.prefix_hit_tokens,
            "prefix_hit_rate": self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0,
            "prefix_reclaimed_blocks": sum(t.reclaimed_blocks for t in trees),
            "prefix_cache_granularity_tokens": self.block_size,
            "prefix_short_prompts": self.prefix_short_prompts,
            **({"compressed_prefixes": len(self.compressed.entries), "compressed_prefix_blocks":
                self.compressed.num_blocks_held} if self.compressed is not None else {}),
            **(self._state_stats() if self.state_pool is not None else {}),
            **(self.connector.stats() if self.connector is not None else {}),
        }
