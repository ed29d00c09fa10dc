"""TierConnector: the KV connector of the tiers below the pool (host, disk, Redis; kvforge.kv.tiers.chain).

Reclaim -> store (write-back): blocks the prefix tree gives back are exported (on the engine thread, before they
can be reused) and queued for the chain's store worker. Write-through tiers (as in SGLang HiCache; disk and Redis
by default, so other processes reuse a block at once) get a block when it enters the prefix tree instead; with no
write-back tier, reclaiming only frees it. Admission -> load: after the pool's longest match, the match continues
block by block through the tiers. The engine thread looks up only tiers that answer from memory (pending stores,
host, disk index); when a remote tier (Redis) may be asked, the lookup runs on the chain's load worker with the
load. The request waits (the scheduler's `loading` list) until the manager's `finish_load` gives what came pool
blocks and this connector imports it. It never runs on half-loaded K/V, and no step waits for a tier.
Swap preemption goes to the first tier under private keys (kvforge.kv.tiers.swap). A recurrent model's state
checkpoints go beside its blocks (kvforge.kv.tiers.state_tiers), and its prefix loads bring the deepest one back.
Compressed prompts (kvzip with reuse) go as one entry each (kvforge.kv.tiers.compressed_tiers).
"""
from __future__ import annotations

from kvforge.kv.connector import BlockIO, KVConnector, Resume, Transfer
from kvforge.kv.tiers.chain import TierChain
from kvforge.kv.tiers.compressed_tiers import CompressedTiers
from kvforge.kv.tiers.keys import KeySpace
from kvforge.kv.tiers.persist import close_tiers
from kvforge.kv.tiers.state_tiers import StateTiers
from kvforge.kv.tiers.swap import SwapSpace


class TierConnector(KVConnector):
    def __init__(self, tiers: TierChain, keys: KeySpace, block_io: BlockIO):
        self.tiers, self.keys, self.block_io = tiers, keys, block_io
        self.block_size = tiers.block_size
        self.stores_reclaimed = bool(tiers.back_tiers)
        self.swap = SwapSpace(tiers, block_io)
        self.states = StateTiers(tiers, keys)
        self.compressed = CompressedTiers(tiers, keys)
        self.held_checkpoints = None  # () -> the state checkpoints in memory, for close (set by the manager)
        self.held_compressed = None  # () -> the compressed prompts in memory, for close (set by the manager)
        self.hit_tokens = 0  # prompt tokens loaded from tiers (also counted in prefix_hit_tokens)
        self.close_stats: dict | None = None  # what close wrote and left (kvforge.kv.tiers.persist)

    # -- loads ----------------------------------------------------------------------------------------

    def start_load(self, tokens: list[int], salt: str | None, matched: int) -> Transfer | None:
        keys = self.keys.chain(tokens, salt)[matched // self.block_size:]
        if not keys:
            return None
        if self.tiers.lookup_may_hang():
            fetch = self.tiers.fetch_run(keys)  # the lookup may hang: it runs on the load worker
        else:
            where = self.tiers.leading_run(keys, local=True)
            if not where:
                return None
            fetch = self.tiers.fetch(keys[:len(where)], where)
        return Transfer(fetch, [], matched)

    def start_state_load(self, tokens: list[int], salt: str | None, matched: int, cached: int
                         ) -> tuple[Transfer | None, int]:
        future, kv_depth = self.states.start_load(tokens, salt, matched, cached)
        return (Transfer(future, [], matched, state_load=(cached, False)) if future is not None else None), kv_depth

    def start_compressed_load(self, policy: str, tokens: list[int], salt: str | None) -> Transfer | None:
        future = self.compressed.start_load(policy, salt, tokens)
        return Transfer(future, [], 0, compressed=True) if future is not None else None

    def adopted_compressed(self, fetch) -> None:
        self.compressed.adopted(fetch)

    def finish_load(self, block_ids: list[int], payloads: list[bytes]) -> None:
        self.block_io.import_blocks(block_ids, payloads)
        self.hit_tokens += len(block_ids) * self.block_size

    # -- stores ---------------------------------------------------------------------------------------

    def on_cached(self, tokens: list[int], salt: str | None, block_ids: list[int], cached_tokens: int) -> None:
        """Write-through: store the blocks that just entered the prefix tree (blocks loaded from a tier are in
        it already, so they are not stored again)."""
        first = cached_tokens // self.block_size
        if self.tiers.through_tiers and first < len(block_ids):
            keys = self.keys.chain(tokens, salt)[first:len(block_ids)]
            self.tiers.store_through(list(zip(keys, self.block_io.export_blocks(block_ids[first:]))))

    def on_reclaimed(self, tokens: list[int], salt: str | None, block_ids: list[int]) -> None:
        keys = self.keys.chain(tokens, salt)[-len(block_ids):]
        self.tiers.store(list(zip(keys, self.block_io.export_blocks(block_ids))))

    def on_checkpoint(self, tokens: list[int], salt: str | None, payload, taken: bool) -> None:
        self.states.store(tokens, salt, payload, through=taken)

    def on_compressed(self, policy: str, tokens: list[int], salt: str | None, rows: int, policy_state,
                      block_ids: list[int], compressed: bool) -> None:
        if self.tiers.through_tiers if compressed else self.tiers.back_tiers:
            self.compressed.store(policy, salt, tokens, rows, policy_state, self.block_io.export_blocks(block_ids),
                                  through=compressed)

    # -- swap -----------------------------------------------------------------------------------------

    def is_swapped(self, request_id: str) -> bool:
        return request_id in self.swap.swapped

    def swapped_requests(self) -> list[str]:
        return list(self.swap.swapped)

    def swapped_blocks(self, request_id: str) -> int:
        return len(self.swap.swapped[request_id].keys)

    def swap_out(self, request_id: str, block_ids: list[int], resume: Resume) -> bool:
        return self.swap.swap_out(request_id, block_ids, resume)

    def swap_in(self, request_id: str, block_ids: list[int]) -> Transfer:
        return self.swap.swap_in(request_id, block_ids)

    def finish_swap_in(self, transfer: Transfer, payloads: list) -> bool:
        return self.swap.finish_swap_in(transfer, payloads)

    # -- lifecycle ------------------------------------------------------------------------------------

    def request_finished(self, request_id: str) -> None:
        self.swap.drop(request_id)

    def cancel(self, transfer: Transfer) -> None:
        if transfer.handle is not None:
            self.tiers.discard(transfer.handle)

    def close(self, prefix_tree, timeout: float) -> dict | None:
        if self.tiers.closed:
            return None
        self.close_stats = close_tiers(self, prefix_tree, timeout)
        return self.close_stats

    def stats(self) -> dict:
        return {**self.tiers.stats_dict(), "tier_hit_tokens": self.hit_tokens, **(self.close_stats or {}),
                **self.swap.stats(), **self.states.stats(),
                **self.compressed.stats()}
