"""SlidingPrefixTree: the prefix cache of a sliding-window KV group.

Same token keys as the full-attention groups' trees, but a hit at h tokens needs only the blocks of the
last window before h, so blocks may be missing (NULL_BLOCK holes) anywhere before. Sequences insert their
tables with the placeholders of blocks they freed behind the window, and reclaiming drops any block only
the tree holds, least recently used node first, even inside a path that is locked: the window blocks a
sequence uses carry its own reference, so a lock never pins what lies behind its window.

A node left with no block (and no child) can never serve a hit, so reclaiming also drops it once no one
locks it: the tree holds only nodes with blocks, or on the path to them, or locked.
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence

from kvforge.kv.groups import NULL_BLOCK, KVGroup
from kvforge.kv.prefix import PrefixTree, RadixNode, real_blocks


class SlidingPrefixTree(PrefixTree):
    def __init__(self, allocator, block_size: int, group: KVGroup):
        super().__init__(allocator, block_size)
        self.group = group

    def usable_prefix(self, tokens: Sequence[int], salt: str | None) -> int:
        """The longest h <= len(tokens) (whole blocks) that is cached with every block of its last window."""
        _, blocks, _ = self._walk(tokens, salt, touch=False)
        h = len(blocks)
        while h > 0 and NULL_BLOCK in blocks[self.group.first_needed_block(h * self.block_size, self.block_size):h]:
            h -= 1
        return h * self.block_size

    def reclaim(self, num_blocks: int) -> int:
        """Drop up to `num_blocks` blocks only the tree holds, least recently used node first; then drop
        every unlocked node left empty. Only nodes holding such a block are ordered, not the whole tree."""
        rc, freed = self.allocator.ref_counts, 0
        heap = [(n.last_access, n.id, n) for n in self._drop_empty_nodes() if any(
            b != NULL_BLOCK and rc[b] == 1 for b in n.block_ids)]
        heapq.heapify(heap)
        emptied = []
        while freed < num_blocks and heap:
            node = heapq.heappop(heap)[2]
            for i, b in enumerate(node.block_ids):
                if freed >= num_blocks:
                    break
                if b != NULL_BLOCK and rc[b] == 1:
                    self.allocator.decref([b])
                    node.block_ids[i] = NULL_BLOCK
                    self.cached_blocks -= 1
                    freed += 1
            emptied.append(node)
        for node in emptied:
            if self._attached(node):  # not already dropped with an emptied child
                self._drop_if_empty(node)
        self.reclaimed_blocks += freed
        return freed

    def _drop_empty_nodes(self) -> list[RadixNode]:
        """Drop every unlocked childless node without a block (children first); returns the nodes kept."""
        kept = []
        for node in self._postorder():
            if not self._drop_if_empty(node, climb=False):
                kept.append(node)
        return kept

    def _drop_if_empty(self, node: RadixNode, climb: bool = True) -> bool:
        """Remove `node` if it is an unlocked leaf without a block, and then (with `climb`) its parents
        that this leaves in the same state; returns whether `node` was removed."""
        removed = False
        while (node.parent is not None and node.parent is not self.root and not node.children
               and node.lock_ref == 0 and not real_blocks(node.block_ids)):
            parent = node.parent
            self._remove_leaf(node)
            removed = True
            if not climb:
                break
            node = parent
        return removed

    def _attached(self, node: RadixNode) -> bool:
        return node.parent is not None and node.parent.children.get(node.tokens[:self.block_size]) is node

    def reclaimable_blocks(self) -> int:
        rc = self.allocator.ref_counts
        return sum(rc[b] == 1 for node in self._postorder() for b in real_blocks(node.block_ids))
