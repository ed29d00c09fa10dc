"""SwapSpace: swap preemption into the tier chain, for the TierConnector.

swap_out exports every block of a preempted request (its exact rows, staged or compacted by a KV policy alike)
to the first tier under private keys; the manager then frees them, and the request keeps its computed tokens,
evicted count and policy statistics (its Resume). At admission, swap-in fetches them on the load worker into
blocks the manager reserved, like a tier load; the request waits in the loading state and resumes bit-exact. If a
block cannot be read back (the tier pushed it out and nothing held it), the request starts over by recompute. The
private keys are discarded after the swap-in (ordered after their store by the chain), and a shared store expires
them in case that never happens. A recurrent model's state slot (Resume.state) is stored beside the blocks under
one more private key and fetched with them: it comes back exactly, or the request recomputes.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, replace

from kvforge.kv.connector import BlockIO, Resume, Transfer
from kvforge.kv.tiers.chain import TierChain
from kvforge.kv.tiers.keys import BlockKey


@dataclass
class SwappedKV:
    keys: list[BlockKey]  # one per block
    resume: Resume  # without its state payload, which is in the tier under state_key
    state_key: BlockKey | None = None


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
        has_state = resume.state is not None
        keys = private_keys(len(block_ids) + has_state)
        payloads = self.block_io.export_blocks(block_ids) + ([resume.state] if has_state else [])
        if not self.tiers.store(list(zip(keys, payloads)), private=True):
            return False
        state_key = keys.pop() if has_state else None
        self.swapped[request_id] = SwappedKV(keys, replace(resume, state=None), state_key)
        self.swapped_out_blocks += len(keys)
        return True

    def swap_in(self, request_id: str, block_ids: list[int]) -> Transfer:
        entry = self.swapped.pop(request_id)
        keys = entry.keys + ([entry.state_key] if entry.state_key is not None else [])
        fetch = self.tiers.fetch_all(keys)
        return Transfer(fetch, block_ids, entry.resume.num_computed, resume=entry.resume, handle=keys)

    def finish_swap_in(self, transfer: Transfer, payloads: list) -> bool:
        self.tiers.discard(transfer.handle)
        if any(p is None for p in payloads):
            self.swap_failures += 1
            return False
        blocks = len(transfer.block_ids)
        self.block_io.import_blocks(transfer.block_ids, payloads[:blocks])
        transfer.resume.state = payloads[blocks] if len(payloads) > blocks else None
        self.swapped_in_blocks += len(transfer.block_ids)
        return True

    def drop(self, request_id: str) -> None:
        entry = self.swapped.pop(request_id, None)
        if entry is not None:
            self.tiers.discard(entry.keys + ([entry.state_key] if entry.state_key is not None else []))

    def stats(self) -> dict:
        return {"swapped_out_blocks": self.swapped_out_blocks, "swapped_in_blocks": self.swapped_in_blocks,
                "swap_failures": self.swap_failures, "swapped_requests": len(self.swapped)}
