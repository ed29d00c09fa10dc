"""SlidingPrefixTree: the prefix cache of a sliding-window KV group.

Same token keys as the full-attention groups' trees, but a hit at h tokens needs only the blocks of the
last window before h, so blocks may be missing (NULL_BLOCK holes) anywhere before. Sequences insert their
tables with the placeholders of blocks they freed behind the window, and reclaiming drops any block only
the tree holds, least recently used node first, even inside a path that is locked: the window blocks a
sequence uses carry its own reference, so a lock never pins what lies behind its window.
"""
from __future__ import annotations

from collections.abc import Sequence

from kvforge.kv.groups import NULL_BLOCK, KVGroup
from kvforge.kv.prefix import PrefixTree, real_blocks


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
        rc, freed = self.allocator.ref_counts, 0
        for node in sorted(self._postorder(), key=lambda n: (n.last_access, n.id)):
            for i, b in enumerate(node.block_ids):
                if freed >= num_blocks:
                    break
                if b != NULL_BLOCK and rc[b] == 1:
                    self.allocator.decref([b])
                    node.block_ids[i] = NULL_BLOCK
                    self.cached_blocks -= 1
                    freed += 1
        self.reclaimed_blocks += freed
        return freed

    def reclaimable_blocks(self) -> int:
        rc = self.allocator.ref_counts
        return sum(rc[b] == 1 for node in self._postorder() for b in real_blocks(node.block_ids))
