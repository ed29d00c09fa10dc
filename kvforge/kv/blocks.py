"""BlockAllocator: physical block ids with reference counts and an O(1) free queue."""
from __future__ import annotations

from collections import deque


class BlockAllocator:
    """Hands out block ids; a block returns to the free queue when its last reference drops.

    References are taken by sequences (their block tables) and by the prefix tree.
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free_queue: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self.free_queue)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_queue):
            raise MemoryError(f"asked for {n} KV blocks, {len(self.free_queue)} free")
        ids = [self.free_queue.popleft() for _ in range(n)]
        for b in ids:
            self.ref_counts[b] = 1
        return ids

    def incref(self, ids: list[int]) -> None:
        for b in ids:
            assert self.ref_counts[b] > 0, f"incref of free block {b}"
            self.ref_counts[b] += 1

    def decref(self, ids: list[int]) -> None:
        """Drop one reference to each block; blocks nobody holds go back to the free queue."""
        for b in ids:
            assert self.ref_counts[b] > 0, f"double free of block {b}"
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_queue.append(b)

    def check(self) -> None:
        """Invariant: a block is free exactly when nobody references it."""
        free = set(self.free_queue)
        assert len(free) == len(self.free_queue), "a block is queued twice"
        for b, rc in enumerate(self.ref_counts):
            assert (rc == 0) == (b in free), f"block {b}: refs={rc}, free={b in free}"
