"""PrefixTree: a radix tree of whole KV blocks (RadixAttention-style prefix cache).

Each edge holds a run of whole blocks: its tokens (a multiple of block_size) and their physical
block ids. Children are keyed by the tokens of their first block, and a hit is confirmed on the
tokens themselves. A partly filled last block is never cached.

Tenants are isolated by salt: the root has one child per salt, and each salt's subtree is its own
radix tree, so requests with different salts never share a block.

The tree holds one allocator reference on every block it caches. Reclaiming drops only blocks whose
last reference is the tree's, so every dropped block really becomes free (see `reclaim`).
("Reclaim" is the prefix cache giving blocks back; "evict" is reserved for KV policies dropping tokens.)
"""
from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import count

from kvforge.kv.blocks import BlockAllocator
from kvforge.kv.groups import NULL_BLOCK

_ids = count()


def real_blocks(block_ids: Sequence[int]) -> list[int]:
    """block_ids without the NULL_BLOCK holes a sliding-window group's tree may hold (kv/sliding_prefix.py)."""
    return [b for b in block_ids if b != NULL_BLOCK]


@dataclass(eq=False)
class RadixNode:
    tokens: tuple[int, ...]
    block_ids: list[int]
    parent: RadixNode | None
    last_access: int = 0
    lock_ref: int = 0
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)
    salt: str | None = None
    id: int = field(default_factory=lambda: next(_ids))


@dataclass(frozen=True)
class PrefixMatch:
    block_ids: list[int]
    num_tokens: int
    node: RadixNode


class PrefixTree:
    """Token blocks -> physical block ids, with lock refs; unlocked leaves are reclaimed LRU first."""

    def __init__(self, allocator: BlockAllocator, block_size: int):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.allocator = allocator
        self.block_size = block_size
        self.root = RadixNode((), [], None)
        self._salts: dict[str | None, RadixNode] = {}
        self._leaves: set[RadixNode] = set()
        self._clock = 0
        self.cached_blocks = 0
        self.reclaimed_blocks = 0
        self.on_reclaim: Callable[[RadixNode], None] | None = None  # sees a leaf's blocks before they are freed

    # ---- lookup -------------------------------------------------------------------------------

    def match_prefix(self, tokens: Sequence[int], salt: str | None = None) -> PrefixMatch:
        """Longest cached whole-block prefix of `tokens`; splits the last edge if the match ends in it.

        The returned node is the handle to `lock`; with no hit it is the root, where locking is a no-op
        for reclaiming.
        """
        node, blocks, partial = self._walk(tokens, salt, touch=True)
        if partial:
            node = self._split(node, partial)
            node.last_access = self._clock
        return PrefixMatch(blocks, len(blocks) * self.block_size, node)

    def peek_prefix(self, tokens: Sequence[int], salt: str | None = None) -> int:
        """Number of leading tokens cached, without touching LRU times or splitting."""
        _, blocks, _ = self._walk(tokens, salt, touch=False)
        return len(blocks) * self.block_size

    def _walk(self, tokens: Sequence[int], salt: str | None, touch: bool) -> tuple[RadixNode, list[int], int]:
        """Returns (deepest node reached, matched block ids, blocks matched inside that node if partial)."""
        node = self._salts.get(salt)
        if node is None:
            return self.root, [], 0
        if touch:
            self._clock += 1
            node.last_access = self._clock
        bs, blocks, pos, last = self.block_size, [], 0, self.root
        n = len(tokens) // bs * bs
        while pos < n:
            child = node.children.get(tuple(tokens[pos:pos + bs]))
            if child is None:
                break
            k = self._common_blocks(child, tokens, pos)
            blocks.extend(child.block_ids[:k])
            pos += k * bs
            if k < len(child.block_ids):
                return child, blocks, k
            if touch:
                child.last_access = self._clock
            node = last = child
        return last, blocks, 0

    def _common_blocks(self, node: RadixNode, tokens: Sequence[int], pos: int) -> int:
        bs, k = self.block_size, 0
        while k < len(node.block_ids) and pos + (k + 1) * bs <= len(tokens):
            if tuple(tokens[pos + k * bs:pos + (k + 1) * bs]) != node.tokens[k * bs:(k + 1) * bs]:
                break
            k += 1
        return k

    # ---- locking ------------------------------------------------------------------------------

    def lock(self, node: RadixNode) -> None:
        """Protect `node` and its ancestors from being reclaimed."""
        n: RadixNode | None = node
        while n is not None:
            n.lock_ref += 1
            n = n.parent

    def unlock(self, node: RadixNode) -> None:
        if node.lock_ref <= 0:
            raise ValueError("unlock of a prefix-tree node that is not locked")
        n: RadixNode | None = node
        while n is not None:
            n.lock_ref -= 1
            n = n.parent

    # ---- insert -------------------------------------------------------------------------------

    def insert(self, tokens: Sequence[int], block_ids: Sequence[int], salt: str | None = None
               ) -> tuple[int, RadixNode | None]:
        """Cache the whole-block prefix of `tokens`, held in `block_ids`; returns (tokens already cached,
        the node that ends at the last whole block, None if there is none).

        The tree takes one reference on the blocks of the new part. Where the prefix is already
        cached, the tree keeps its own blocks and takes no reference on the caller's duplicates.
        """
        bs = self.block_size
        nb = len(tokens) // bs
        if len(block_ids) < nb:
            raise ValueError(f"{len(tokens)} tokens fill {nb} blocks of {bs}, got only {len(block_ids)} block ids")
        if nb == 0:
            return 0, None
        self._clock += 1
        node = self._salts.get(salt)
        if node is None:
            node = self._salts[salt] = RadixNode((), [], self.root, salt=salt)
        node.last_access = self._clock
        pos, n = 0, nb * bs
        while pos < n:
            child = node.children.get(tuple(tokens[pos:pos + bs]))
            if child is None:
                new = list(block_ids[pos // bs:nb])
                self.allocator.incref(real_blocks(new))
                leaf = RadixNode(tuple(tokens[pos:n]), new, node, self._clock)
                node.children[leaf.tokens[:bs]] = leaf
                self._leaves.discard(node)
                self._leaves.add(leaf)
                self.cached_blocks += len(real_blocks(new))
                return pos, leaf
            k = self._common_blocks(child, tokens, pos)
            if k < len(child.block_ids):
                child = self._split(child, k)
            child.last_access = self._clock
            pos += k * bs
            node = child
        return pos, node

    def _split(self, node: RadixNode, k: int) -> RadixNode:
        """Cut `node` after its first k blocks; returns the new head, `node` keeps the tail."""
        bs, parent = self.block_size, node.parent
        assert parent is not None and 0 < k < len(node.block_ids)
        head = RadixNode(node.tokens[:k * bs], node.block_ids[:k], parent, node.last_access, node.lock_ref)
        node.tokens, node.block_ids, node.parent = node.tokens[k * bs:], node.block_ids[k:], head
        head.children[node.tokens[:bs]] = node
        parent.children[head.tokens[:bs]] = head
        return head

    # ---- reclaiming blocks -----------------------------------------------------------------------------

    def reclaim(self, num_blocks: int) -> int:
        """Free at least `num_blocks` blocks from unlocked leaves, least recently used first.

        A leaf gives up its trailing run of blocks that only the tree references (the edge is split
        if a block someone else holds precedes them); a leaf whose last block is held elsewhere
        stays cached, since dropping it would free nothing. So every block dropped becomes free,
        and the return value (blocks freed) equals blocks dropped. Stops early when nothing
        reclaimable remains.
        """
        heap = [(n.last_access, n.id, n) for n in self._leaves if n.lock_ref == 0]
        heapq.heapify(heap)
        rc, freed = self.allocator.ref_counts, 0
        while freed < num_blocks and heap:
            _, _, node = heapq.heappop(heap)
            k = len(node.block_ids)
            while k > 0 and rc[node.block_ids[k - 1]] == 1:
                k -= 1
            if k == len(node.block_ids):
                continue
            if k > 0:
                self._split(node, k)
            parent = node.parent
            assert parent is not None
            if self.on_reclaim is not None:
                self.on_reclaim(node)
            freed += self._remove_leaf(node)
            if k == 0 and parent in self._leaves and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        self.reclaimed_blocks += freed
        return freed

    def path(self, node: RadixNode) -> tuple[str | None, list[int]]:
        """The salt of `node`'s subtree and every token from its salt root down to the end of `node`."""
        parts, n = [], node
        while n.parent is not None and n.parent is not self.root:
            parts.append(n.tokens)
            n = n.parent
        return n.salt, [t for p in reversed(parts) for t in p]

    def _remove_leaf(self, node: RadixNode) -> int:
        parent = node.parent
        assert parent is not None and not node.children
        self.allocator.decref(real_blocks(node.block_ids))
        del parent.children[node.tokens[:self.block_size]]
        self._leaves.discard(node)
        self.cached_blocks -= len(real_blocks(node.block_ids))
        if not parent.children:
            if parent.parent is self.root:
                del self._salts[parent.salt]
            else:
                self._leaves.add(parent)
        return len(node.block_ids)

    def reclaimable_blocks(self) -> int:
        """Blocks `reclaim` could free now: exactly what reclaim(everything) would return."""
        rc, total = self.allocator.ref_counts, 0
        gone: dict[RadixNode, bool] = {}
        for node in self._postorder():
            if node.lock_ref > 0 or not all(gone[c] for c in node.children.values()):
                gone[node] = False
                continue
            k = len(node.block_ids)
            while k > 0 and rc[node.block_ids[k - 1]] == 1:
                k -= 1
            total += len(node.block_ids) - k
            gone[node] = k == 0
        return total

    def nodes(self) -> list[RadixNode]:
        """Every node below the salt roots, parents before children."""
        return self._postorder()[::-1]

    # ---- invariants ---------------------------------------------------------------------------

    def num_nodes(self) -> int:
        """Nodes below the salt roots (a tree that caches nothing has none)."""
        return len(self._postorder())

    def _postorder(self) -> list[RadixNode]:
        """Every node below the salt roots, children before parents."""
        out: list[RadixNode] = []
        stack = [c for s in self._salts.values() for c in s.children.values()]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out[::-1]

    def check(self) -> None:
        bs, seen = self.block_size, set()
        assert self.root.lock_ref >= sum(s.lock_ref for s in self._salts.values()), "root lock_ref"
        for salt, s in self._salts.items():
            assert s.parent is self.root and s.salt == salt and s.children, f"salt root {salt!r}"
            assert s.lock_ref >= sum(c.lock_ref for c in s.children.values()), f"salt {salt!r} lock_ref"
        for node in self._postorder():
            assert node.parent is not None
            assert node.tokens and len(node.tokens) == len(node.block_ids) * bs, "edge is not whole blocks"
            assert node.parent.children.get(node.tokens[:bs]) is node, "child key != first block"
            assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()) >= 0, "lock_ref"
            assert (node in self._leaves) == (not node.children), "leaf set out of date"
            for b in real_blocks(node.block_ids):
                assert b not in seen, f"block {b} cached twice"
                seen.add(b)
                assert self.allocator.ref_counts[b] >= 1, f"cached block {b} has no reference"
        assert len(seen) == self.cached_blocks, f"cached_blocks={self.cached_blocks}, tree holds {len(seen)}"
        assert len(self._leaves) == sum(1 for n in self._postorder() if not n.children)
