"""StateTiers: a recurrent model's state checkpoints in the tiers beside its KV blocks, for the TierConnector.

A checkpoint taken after a block boundary is stored under the state key of that block's chain key
(kvforge.kv.tiers.keys: model, KV format, block size, state groups, salt and every token before it), as one entry
of `StatePool.checkpoint_payload` bytes. Write-through tiers (disk, Redis) get it when it is taken, as they get the
block's KV; write-back tiers (host) when the in-memory checkpoint LRU evicts it. At admission the lookup continues
past the pool: the KV blocks the tiers hold after the pool's, then, from that depth down, the first boundary whose
checkpoint some tier holds; that checkpoint and the KV blocks up to it are fetched, so a request resumes from the
deepest block that has both its KV (pool or tier) and a checkpoint (memory or tier). A checkpoint missing from the
tiers means a shallower one; none means the request runs from what the pool gave it.
"""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from kvforge.kv.tiers.chain import TierChain
from kvforge.kv.tiers.keys import BlockKey, KeySpace


@dataclass
class StateFetch:
    """What a recurrent model's prefix load brings: the KV blocks after the pool's up to `resume`, then the
    checkpoint after `resume` tokens (payloads empty and resume 0: no checkpoint found)."""
    payloads: list[bytes | None]
    kv_depth: int  # tokens whose KV the pool or a tier holds
    resume: int


class StateTiers:
    def __init__(self, tiers: TierChain, keys: KeySpace):
        self.tiers, self.keys, self.block_size = tiers, keys, keys.block_size
        self.stored = 0  # checkpoints queued for a tier

    def key(self, tokens: list[int], salt: str | None) -> BlockKey:
        """The entry of the checkpoint after `tokens` (whole blocks)."""
        return self.keys.state_key(self.keys.chain(tokens, salt)[-1])

    def store(self, tokens: list[int], salt: str | None, payload: Callable[[], bytes], through: bool) -> None:
        """Queue a checkpoint for the write-through tiers (`through`: it was just taken) or the write-back chain
        (it left the in-memory LRU)."""
        targets = self.tiers.through_tiers if through else self.tiers.back_tiers
        if not targets or not tokens:
            return
        items = [(self.key(tokens, salt), payload())]
        if self.tiers.store_through(items) if through else self.tiers.store(items):
            self.stored += 1

    def start_load(self, tokens: list[int], salt: str | None, matched: int, cached: int) -> tuple[Future | None, int]:
        """Look for the deepest checkpoint after `matched` tokens (the pool's checkpoint depth) whose KV blocks the
        pool (`cached` tokens) and the tiers hold, and fetch it with the blocks past the pool's. Returns a future of
        a StateFetch (None: nothing to fetch, found here) and the KV depth known now."""
        keys = self.keys.chain(tokens, salt)
        first, low = cached // self.block_size, matched // self.block_size
        if first >= len(keys) and first == low:
            return None, cached
        if self.tiers.lookup_may_hang():  # Redis may be asked: look up on the load worker too
            return self.tiers.submit(lambda: self._fetch(keys, first, low, False)), cached
        plan = self._plan(keys, first, low, local=True)
        if plan[0] is None:
            return None, plan[2]
        return self.tiers.submit(lambda: self._load(*plan)), plan[2]

    def _plan(self, keys: list[BlockKey], first: int, low: int, local: bool):
        """(entries to load, their tiers, KV depth, resume depth): KV blocks first..j, the checkpoint after j."""
        where = self.tiers.leading_run(keys[first:], local)
        depth = first + len(where)
        for j in range(depth, low, -1):
            state_key = self.keys.state_key(keys[j - 1])
            t = self.tiers.holder(state_key, local)
            if t is not None:
                n = max(0, j - first)
                return keys[first:first + n] + [state_key], where[:n] + [t], depth * self.block_size, j * self.block_size
        return None, None, depth * self.block_size, 0

    def _load(self, entries, where, kv_depth: int, resume: int) -> StateFetch:
        return StateFetch(self.tiers.load(entries, where), kv_depth, resume)

    def _fetch(self, keys: list[BlockKey], first: int, low: int, local: bool) -> StateFetch:
        plan = self._plan(keys, first, low, local)
        return StateFetch([], plan[2], 0) if plan[0] is None else self._load(*plan)

    def stats(self) -> dict:
        return {"state_checkpoints_to_tiers": self.stored}
