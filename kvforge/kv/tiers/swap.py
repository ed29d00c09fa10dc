"""SwapSpace: swap preemption into the tier chain, for the TierConnector.

swap_out exports every block of a preempted request (its exact rows, staged or compacted by a KV policy alike)
to the first tier under private keys; the manager then frees them, and the request keeps its computed tokens,
evicted count and policy statistics (its Resume). At admission, swap-in fetches them on the load worker into
blocks the manager reserved, like a tier load; the request waits in the loading state and resumes bit-exact. If a
block cannot be read back (the tier pushed it out and nothing held it), the request starts over by recompute. The
private keys are discarded after the swap-in (ordered after their store by the chain), and a shared store expires
them in case that never happens.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass

from kvforge.kv.connector import BlockIO, Resume, Transfer
from kvforge.kv.tiers.chain import TierChain
from kvforge.kv.tiers.keys import BlockKey


@dataclass
class SwappedKV:
    keys: list[BlockKey]
    resume: Resume


def private_keys(n: int) -> list[BlockKey]:
    tag = uuid.uuid4().bytes
    return [BlockKey(0, bytes(a ^ b for a, b in zip(tag, i.to_bytes(16, "little")))) for i in range(n)]


class SwapSpace:
    def __init__(self, tiers: TierChain, block_io: BlockIO):
        self.tiers, self.block_io = tiers, block_io
        self.swapped: dict[str, SwappedKV] = {}
        self.swapped_out_blocks = self.swapped_in_blocks = self.swap_failures = 0

    def swap_out(self, request_id: str, block_ids: list[int], resume: Resume) -> bool:
        """Store the blocks under private keys; False when the store queue is full (preempt by recompute instead)."""
        keys = private_keys(len(block_ids))
        if not self.tiers.store(list(zip(keys, self.block_io.export_blocks(block_ids))), private=True):
            return False
        self.swapped[request_id] = SwappedKV(keys, resume)
        self.swapped_out_blocks += len(keys)
        return True

    def swap_in(self, request_id: str, block_ids: list[int]) -> Transfer:
        entry = self.swapped.pop(request_id)
        fetch = self.tiers.fetch_all(entry.keys)
        return Transfer(fetch, block_ids, entry.resume.num_computed, resume=entry.resume, handle=entry.keys)

    def finish_swap_in(self, transfer: Transfer, payloads: list) -> bool:
        self.tiers.discard(transfer.handle)
        if any(p is None for p in payloads):
            self.swap_failures += 1
            return False
        self.block_io.import_blocks(transfer.block_ids, payloads)
        self.swapped_in_blocks += len(transfer.block_ids)
        return True

    def drop(self, request_id: str) -> None:
        entry = self.swapped.pop(request_id, None)
        if entry is not None:
            self.tiers.discard(entry.keys)

    def stats(self) -> dict:
        return {"swapped_out_blocks": self.swapped_out_blocks, "swapped_in_blocks": self.swapped_in_blocks,
                "swap_failures": self.swap_failures, "swapped_requests": len(self.swapped)}
