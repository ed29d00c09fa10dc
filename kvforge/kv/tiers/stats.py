"""Counters of one tier: lookups, hits, blocks and bytes stored/loaded/evicted, latencies, failures, skips."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

LATENCY_SAMPLES = 2048


def _percentile(values, q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class TierStats:
    queried_blocks: int = 0
    hit_blocks: int = 0
    stored_blocks: int = 0
    stored_bytes: int = 0
    loaded_blocks: int = 0
    loaded_bytes: int = 0
    evicted_blocks: int = 0
    failed_loads: int = 0
    failed_stores: int = 0
    skipped_blocks: int = 0  # lookups, loads and stores not made while the tier's breaker was open
    dropped_stores: int = 0  # blocks not stored because the store queue was full (counted on the first tier)
    load_seconds: float = 0.0
    store_seconds: float = 0.0
    load_latency: deque = field(default_factory=lambda: deque(maxlen=LATENCY_SAMPLES))
    store_latency: deque = field(default_factory=lambda: deque(maxlen=LATENCY_SAMPLES))

    def loaded(self, blocks: int, nbytes: int, seconds: float) -> None:
        self.loaded_blocks += blocks
        self.loaded_bytes += nbytes
        self.load_seconds += seconds
        self.load_latency.append(seconds)

    def stored(self, blocks: int, nbytes: int, seconds: float) -> None:
        self.stored_blocks += blocks
        self.stored_bytes += nbytes
        self.store_seconds += seconds
        self.store_latency.append(seconds)

    def as_dict(self, prefix: str, block_size: int, used_bytes: int) -> dict:
        load = list(self.load_latency)
        store = list(self.store_latency)
        return {
            f"{prefix}_queried_tokens": self.queried_blocks * block_size,
            f"{prefix}_hit_tokens": self.hit_blocks * block_size,
            f"{prefix}_stored_blocks": self.stored_blocks,
            f"{prefix}_stored_bytes": self.stored_bytes,
            f"{prefix}_loaded_blocks": self.loaded_blocks,
            f"{prefix}_loaded_bytes": self.loaded_bytes,
            f"{prefix}_evicted_blocks": self.evicted_blocks,
            f"{prefix}_failed_loads": self.failed_loads,
            f"{prefix}_failed_stores": self.failed_stores,
            f"{prefix}_skipped_blocks": self.skipped_blocks,
            f"{prefix}_dropped_stores": self.dropped_stores,
            f"{prefix}_load_p50_ms": 1e3 * _percentile(load, 0.5),
            f"{prefix}_load_p99_ms": 1e3 * _percentile(load, 0.99),
            f"{prefix}_store_p50_ms": 1e3 * _percentile(store, 0.5),
            f"{prefix}_store_p99_ms": 1e3 * _percentile(store, 0.99),
            f"{prefix}_load_gbps": self.loaded_bytes / self.load_seconds / 1e9 if self.load_seconds else 0.0,
            f"{prefix}_store_gbps": self.stored_bytes / self.store_seconds / 1e9 if self.store_seconds else 0.0,
            f"{prefix}_used_bytes": used_bytes,
        }
