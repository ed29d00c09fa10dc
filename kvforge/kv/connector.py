"""KVConnector: the one seam through which KV moves between the pool and anything else (tiers, swap, recurrent
state checkpoints; later a GPU copy engine), in the shape of vLLM v1's KV connectors and LMCache.

Two halves. The worker half (`BlockIO`) exports a block's exact stored bytes and imports them into pool blocks:
the pool, or a target's and its draft model's pools as one (kvforge.kv.pool_pair). The scheduler half decides what
to look up, load and store, and holds what is in flight; the KVCacheManager calls it at a few points and keeps
every block, table and prefix-tree node itself:

  admission            start_load (after the prefix tree's match)  -> a Transfer the request waits on
                       start_state_load (a recurrent model: KV blocks and the deepest state checkpoint)
  may it run?          done(transfer) / wait(transfer); finish_load imports what came (the manager gives blocks)
  a block is cached    on_cached (write-through)
  a state checkpoint   on_checkpoint: taken (write-through) or evicted from the in-memory LRU (write-back)
  a block is reclaimed on_reclaimed (write-back), when `stores_reclaimed`
  a compressed prompt  on_compressed: compressed (write-through) or given way in memory (write-back);
                       start_compressed_load at admission, when memory holds none
  preemption           swap_out / swap_in / finish_swap_in
  free, abort          request_finished (a swapped request's record), cancel (a transfer in flight)
  close, stats         close(prefix tree) persists what a restart should find; stats
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol


class BlockIO(Protocol):
    """The worker half: whole blocks' exact stored state as bytes, out of pool blocks and back into others."""

    def export_blocks(self, block_ids: list[int]) -> list[bytes]: ...

    def import_blocks(self, block_ids: list[int], payloads: list) -> None: ...


@dataclass
class Resume:
    """What a swapped-out request resumes with besides its blocks."""
    num_computed: int
    num_evicted: int
    policy_state: Any
    state: bytes | None = None  # a recurrent model's state slot (StatePool.export_slot): it moves with the blocks


@dataclass
class Transfer:
    """Blocks on their way into the pool for one request (held in its RequestKV while in flight)."""
    future: Future  # -> list[bytes | None], one payload per block
    block_ids: list[int]  # pool blocks reserved for them (a swap-in); a prefix load gets its blocks when they arrive
    matched: int  # tokens the request held from the pool before the transfer
    resume: Resume | None = None  # a swap-in's saved state; None: a prefix load
    handle: Any = None  # the connector's own (a swap-in's private keys)
    state_load: tuple[int, bool] | None = None  # a recurrent model's prefix load: (tokens the pool held, count its
    # shortfall); its future gives a kvforge.kv.tiers.state_tiers.StateFetch
    compressed: bool = False  # a compressed prompt's load: its future gives a CompressedFetch or None


class KVConnector(ABC):
    block_io: BlockIO
    stores_reclaimed = False  # True: the manager hands it every prefix-tree leaf about to be freed

    # -- loads ---------------------------------------------------------------------------------------

    @abstractmethod
    def start_load(self, tokens: list[int], salt: str | None, matched: int) -> Transfer | None:
        """Start fetching the whole blocks of `tokens` after the first `matched` tokens that it holds, in order;
        None when it holds none."""

    def done(self, transfer: Transfer) -> bool:
        return transfer.future.done()

    def wait(self, transfer: Transfer, timeout: float) -> None:
        try:
            transfer.future.exception(timeout=timeout)
        except TimeoutError:
            pass

    def start_state_load(self, tokens: list[int], salt: str | None, matched: int, cached: int
                         ) -> tuple[Transfer | None, int]:
        """A recurrent model's start_load: the deepest state checkpoint after `matched` tokens (the in-memory one's
        depth) with the KV blocks past the pool's `cached` tokens up to it. Returns the transfer (None: nothing
        found) and the tokens whose KV is known to be held."""
        return None, cached

    def start_compressed_load(self, policy: str, tokens: list[int], salt: str | None) -> Transfer | None:
        """Start fetching the longest compressed prompt (policy namespace `policy`) that is a strict prefix of
        `tokens`; None when none is held."""
        return None

    def adopted_compressed(self, fetch) -> None:
        """A compressed prompt that came in was adopted (counted)."""

    @abstractmethod
    def finish_load(self, block_ids: list[int], payloads: list[bytes]) -> None:
        """Import a prefix load's leading good payloads into `block_ids` (given by the manager)."""

    # -- stores ----------------------------------------------------------------------------------------

    def on_cached(self, tokens: list[int], salt: str | None, block_ids: list[int], cached_tokens: int) -> None:
        """`block_ids` (of `tokens`' whole blocks) are in the prefix tree; those after `cached_tokens` are new."""

    def on_reclaimed(self, tokens: list[int], salt: str | None, block_ids: list[int]) -> None:
        """A prefix-tree leaf, the last blocks of `tokens`, is about to be freed."""

    def on_checkpoint(self, tokens: list[int], salt: str | None, payload: Callable[[], bytes], taken: bool) -> None:
        """A state checkpoint after `tokens` was taken (`taken`) or left the in-memory LRU; `payload()` its bytes."""

    def on_compressed(self, policy: str, tokens: list[int], salt: str | None, rows: int, policy_state,
                      block_ids: list[int], compressed: bool) -> None:
        """A compressed prompt of `tokens` in `block_ids` was just compressed (`compressed`) or leaves memory."""

    # -- swap ------------------------------------------------------------------------------------------

    def is_swapped(self, request_id: str) -> bool:
        return False

    def swapped_requests(self) -> list[str]:
        return []

    def swapped_blocks(self, request_id: str) -> int:
        raise KeyError(request_id)

    def swap_out(self, request_id: str, block_ids: list[int], resume: Resume) -> bool:
        """Move a preempted request's blocks out (the manager frees them after); False: recompute instead."""
        return False

    def swap_in(self, request_id: str, block_ids: list[int]) -> Transfer:
        raise KeyError(request_id)

    def finish_swap_in(self, transfer: Transfer, payloads: list) -> bool:
        """Import a swap-in into its reserved blocks and put its state payload back in `transfer.resume.state`;
        False when a block or the state was lost (the request recomputes)."""
        raise NotImplementedError

    # -- lifecycle --------------------------------------------------------------------------------------

    def request_finished(self, request_id: str) -> None:
        """The request is gone: forget what is held for it."""

    def cancel(self, transfer: Transfer) -> None:
        """A transfer in flight is abandoned (the manager gives back its blocks)."""

    def close(self, prefix_tree, timeout: float) -> dict | None:
        """Keep what a restart should find; a second call does nothing."""
        return None

    def stats(self) -> dict:
        return {}
