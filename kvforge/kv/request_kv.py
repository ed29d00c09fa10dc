"""RequestKV: what the KV cache holds for one request; the KVCacheManager is its only writer."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestKV:
    block_tables: list[list[int]] = field(default_factory=lambda: [[]])  # one per KV group (kvforge.kv.groups)
    prefix_nodes: list[Any] = field(default_factory=list)  # locked prefix-tree node per group's tree (RadixNode)
    num_matched: int = 0  # tokens adopted from the prefix cache at admission
    num_adopted: int = 0  # of those, tokens in blocks shared with others (never in this request's fp16 window)
    staged: list[int] = field(default_factory=list)  # blocks in this request's fp16 window (kvforge.kv.staging)
    pinned: list[int] = field(default_factory=list)  # its first block per group, whose exact sink rows stay
    parked: bool = False  # holds `staged` but does not run: may_stage is off for them (StagingWindows.park)
    num_evicted: int = 0  # computed tokens a KV policy dropped from the cache (full-attention groups)
    policy_state: Any = None  # the KV policy's statistics (kvforge.kv.policies.PolicyState)
    load: Any = None  # blocks on their way in through the KV connector (kvforge.kv.connector.Transfer)
    state_slot: int | None = None  # its slot in the recurrent state pool (kvforge.kv.state_pool), recurrent models

    @property
    def block_table(self) -> list[int]:
        return self.block_tables[0]

    @property
    def prefix_node(self) -> Any:
        return self.prefix_nodes[0] if self.prefix_nodes else None
