"""RequestKV: what the KV cache holds for one request; the KVCacheManager is its only writer."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

NUM_KV_GROUPS = 1  # every layer shares one block table today; per-layer KV groups add tables here


@dataclass
class RequestKV:
    block_tables: list[list[int]] = field(default_factory=lambda: [[] for _ in range(NUM_KV_GROUPS)])
    prefix_node: Any = None  # the locked prefix-tree node (kvforge.kv.prefix.RadixNode) while the request holds it
    num_matched: int = 0  # tokens adopted from the prefix cache at admission
    num_evicted: int = 0  # computed tokens a KV policy dropped from the cache
    policy_state: Any = None  # the KV policy's statistics (kvforge.kv.policies.PolicyState)
    load: Any = None  # blocks being fetched from KV tiers (kvforge.kv.tiers.hooks.PendingLoad)

    @property
    def block_table(self) -> list[int]:
        return self.block_tables[0]
