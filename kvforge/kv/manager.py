"""KVCacheManager: the facade the scheduler talks to (block tables, slots, prefix reuse)."""
from __future__ import annotations

import torch

from kvforge.engine.sequence import Sequence
from kvforge.kv.blocks import BlockAllocator
from kvforge.kv.formats import KVFormat
from kvforge.kv.memory import blocks_for_tokens, bytes_per_block
from kvforge.kv.pool import KVPool
from kvforge.kv.spec import KVCacheSpec


class KVCacheManager:
    def __init__(self, spec: KVCacheSpec, fmt: KVFormat, num_blocks: int, block_size: int, device: torch.device,
                 layout: str = "paged", max_model_len: int = 4096, enable_prefix_caching: bool = False,
                 max_num_seqs: int = 1):
        self.spec, self.format, self.block_size, self.layout = spec, fmt, block_size, layout
        self.max_model_len = max_model_len
        self.pool = KVPool(spec, fmt, num_blocks, block_size, device, max_num_seqs)
        self.allocator = BlockAllocator(num_blocks)
        self.block_bytes = bytes_per_block(spec, fmt, block_size)
        self.prefix_tree = None
        if enable_prefix_caching and layout == "paged":
            from kvforge.kv.prefix import PrefixTree

            self.prefix_tree = PrefixTree(self.allocator, block_size)
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        self.peak_blocks_used = 0
        self.prefix_short_prompts = 0  # prompts of at most one block: nothing of them can ever be cached

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    def blocks_for_request(self, num_tokens: int) -> int:
        """Blocks a request of num_tokens holds at most under this layout."""
        if self.layout == "contiguous":
            return blocks_for_tokens(self.max_model_len, self.block_size)
        return blocks_for_tokens(num_tokens, self.block_size)

    def match_prefix(self, seq: Sequence) -> None:
        """On admission: adopt the longest cached prefix (whole blocks, at least one token left to compute)."""
        if self.prefix_tree is None or seq.block_table:
            return
        usable = (seq.num_tokens - 1) // self.block_size * self.block_size
        match = self.prefix_tree.match_prefix(seq.token_ids[:usable], salt=seq.cache_salt)
        if match.num_tokens:
            self.prefix_tree.lock(match.node)
            seq.prefix_node = match.node
            self.allocator.incref(match.block_ids)
            seq.block_table = list(match.block_ids)
            seq.num_computed_tokens = match.num_tokens
            seq.metrics.cached_tokens = max(seq.metrics.cached_tokens, match.num_tokens)

    def record_admission(self, seq: Sequence) -> None:
        """Count the prefix-cache lookup of a sequence that was admitted (hits are its computed tokens)."""
        if self.prefix_tree is None:
            return
        self.prefix_queried_tokens += seq.num_tokens
        self.prefix_hit_tokens += seq.num_computed_tokens
        if seq.num_tokens <= self.block_size:
            self.prefix_short_prompts += 1

    def uncached_head(self, seq: Sequence) -> tuple | None:
        """Key of the first block seq must still compute, when that block could be shared (else None)."""
        if self.prefix_tree is None:
            return None
        start, bs = seq.num_computed_tokens, self.block_size
        if seq.num_tokens - start <= bs:
            return None
        return seq.cache_salt, start, tuple(seq.token_ids[start: start + bs]), tuple(seq.token_ids[:start][-bs:])

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for num_new_tokens more tokens of seq; False when the cache is full."""
        if self.layout == "contiguous" and not seq.block_table:
            need = blocks_for_tokens(self.max_model_len, self.block_size)
        else:
            need = blocks_for_tokens(seq.cache_len + num_new_tokens, self.block_size) - len(seq.block_table)
        if need <= 0:
            return True
        if not self.allocator.can_allocate(need) and self.prefix_tree is not None:
            self.prefix_tree.evict(need - self.allocator.num_free)
        if not self.allocator.can_allocate(need):
            return False
        seq.block_table.extend(self.allocator.allocate(need))
        self.peak_blocks_used = max(self.peak_blocks_used, self.allocator.num_used)
        return True

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Offer seq's full computed blocks to the prefix tree so concurrent requests can share them."""
        if self.prefix_tree is None:
            return
        full = seq.num_computed_tokens // self.block_size
        if full == 0:
            return
        tokens = seq.token_ids[: full * self.block_size]
        _, node = self.prefix_tree.insert_path(tokens, seq.block_table[:full], salt=seq.cache_salt)
        self.prefix_tree.lock(node)
        if seq.prefix_node is not None:
            self.prefix_tree.unlock(seq.prefix_node)
        seq.prefix_node = node

    def free(self, seq: Sequence, cache: bool = True) -> None:
        """Release seq's blocks; with cache, its computed full blocks stay in the prefix cache
        (cache=False after a failed step: blocks it may have half-written are never shared)."""
        if cache and self.prefix_tree is not None and seq.block_table:
            self.cache_computed_blocks(seq)
        if seq.prefix_node is not None:
            self.prefix_tree.unlock(seq.prefix_node)
            seq.prefix_node = None
        self.allocator.decref(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_evicted, seq.policy_state = 0, None

    def slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        bs, table = self.block_size, seq.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def reset_prefix_cache(self) -> int:
        """Drop every cached block nobody is using; returns blocks freed."""
        if self.prefix_tree is None:
            return 0
        return self.prefix_tree.evict(self.allocator.num_blocks)

    def stats(self) -> dict:
        used = self.allocator.num_used
        cached = self.prefix_tree.evictable_blocks() if self.prefix_tree is not None else 0
        return {
            "kv_blocks_total": self.allocator.num_blocks,
            "kv_blocks_used": used,
            "kv_blocks_used_peak": self.peak_blocks_used,
            "kv_blocks_free": self.allocator.num_free,
            "kv_blocks_cached_idle": cached,
            "kv_block_size": self.block_size,
            "kv_bytes_per_block": self.block_bytes,
            "kv_bytes_total": self.allocator.num_blocks * self.block_bytes,
            "kv_bytes_used": used * self.block_bytes,
            "kv_usage": used / max(1, self.allocator.num_blocks),
            "prefix_queried_tokens": self.prefix_queried_tokens,
            "prefix_hit_tokens": self.prefix_hit_tokens,
            "prefix_hit_rate": self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0,
            "prefix_evicted_blocks": self.prefix_tree.evicted_blocks if self.prefix_tree is not None else 0,
            "prefix_cache_granularity_tokens": self.block_size,
            "prefix_short_prompts": self.prefix_short_prompts,
        }
