"""Tier: one level of block storage below the pool, addressed by BlockKey, holding exact block payloads."""
from __future__ import annotations

from abc import ABC, abstractmethod

from kvforge.kv.tiers.keys import BlockKey


class Tier(ABC):
    """`put` may return entries it pushed out to make room (the chain hands them to the next tier).

    Every method may raise OSError or a client error; the chain counts it and treats the call as a miss.
    `get` returns None for a key it does not hold or whose stored entry failed its checks.
    """

    name: str
    capacity_bytes: int | None = None  # None: bounded by the store itself (Redis's maxmemory)
    shared = False  # other processes read it and it outlives this one (disk, Redis): write-through by default
    remote = False  # calls cross the network and may hang: the engine thread never makes them

    @abstractmethod
    def contains(self, keys: list[BlockKey]) -> list[bool]: ...

    @abstractmethod
    def get(self, keys: list[BlockKey]) -> list[bytes | None]: ...

    @abstractmethod
    def put(self, items: list[tuple[BlockKey, bytes]], private: frozenset[BlockKey] = frozenset()
            ) -> list[tuple[BlockKey, bytes]]:
        """Store items; `private` keys (a swapped request's blocks) are read once and discarded: a shared store
        gives them an expiry, so a key whose discard never arrives (a crash) does not stay forever."""

    @abstractmethod
    def used_bytes(self) -> int: ...

    def discard(self, keys: list[BlockKey]) -> None:
        """Drop these entries if held (no error when not)."""

    def close(self) -> None:
        """Release connections and files (the stored blocks stay where they persist)."""
