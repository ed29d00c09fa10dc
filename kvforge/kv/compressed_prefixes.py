"""Compressed prompts kept for later requests: a query-agnostic policy (kvzip) compresses a context once and every
request whose prompt starts with that context adopts the compressed blocks instead of recomputing and rescoring it.

An entry is keyed by a namespace that names the method and its options (budget included), the request's cache salt
and the context's token ids; it holds a reference on each of the compressed sequence's blocks (whole blocks only:
the kept row count is a multiple of the block size, so no adopter ever writes into a shared block), the rows kept,
and a copy of the policy's statistics (so an adopter is known as compressed and is not scored again). Entries go
least recently used first when the allocator runs short, as prefix-tree leaves do (`on_reclaim` sees each first:
the KV tiers' write-back).
"""
from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvforge.kv.blocks import BlockAllocator


@dataclass
class CompressedPrefix:
    block_tables: list[list[int]]  # per KV group
    rows: int  # cache rows the compressed context occupies (a multiple of the block size)
    num_tokens: int  # context tokens it stands for
    policy_state: Any  # the policy's statistics after compression (copied for each adopter)


class CompressedPrefixes:
    def __init__(self, allocator: BlockAllocator, namespace: str):
        self.allocator, self.namespace = allocator, namespace
        self.entries: OrderedDict[tuple, CompressedPrefix] = OrderedDict()
        self.lengths: dict[int, int] = {}  # context length -> entries of that length (the lengths worth trying)
        self.stored = 0
        self.on_reclaim: Callable[[str | None, list[int], CompressedPrefix], None] | None = None  # (salt, tokens, entry)

    def _key(self, salt: str | None, tokens) -> tuple:
        return self.namespace, salt, tuple(tokens)

    def store(self, salt: str | None, tokens: list[int], block_tables: list[list[int]], rows: int, policy_state) -> bool:
        """Keep an entry; False when one of these tokens is kept already."""
        key = self._key(salt, tokens)
        if key in self.entries:
            self.entries.move_to_end(key)
            return False
        tables = [list(t) for t in block_tables]
        for t in tables:
            self.allocator.incref(t)
        self.entries[key] = CompressedPrefix(tables, rows, len(tokens), copy.deepcopy(policy_state))
        self.lengths[len(tokens)] = self.lengths.get(len(tokens), 0) + 1
        self.stored += 1
        return True

    def match(self, salt: str | None, tokens: list[int]) -> CompressedPrefix | None:
        """The longest stored context that is a strict prefix of tokens (one token at least is left to compute)."""
        for n in sorted(self.lengths, reverse=True):
            if n < len(tokens):
                key = self._key(salt, tokens[:n])
                entry = self.entries.get(key)
                if entry is not None:
                    self.entries.move_to_end(key)
                    return entry
        return None

    def adopt(self, entry: CompressedPrefix) -> tuple[list[list[int]], Any]:
        """An adopter's own references on the entry's blocks, and its copy of the policy's statistics."""
        tables = [list(t) for t in entry.block_tables]
        for t in tables:
            self.allocator.incref(t)
        return tables, copy.deepcopy(entry.policy_state)

    def reclaim(self, num_blocks: int) -> int:
        """Drop least recently used entries until num_blocks blocks came free (or none is left)."""
        freed = 0
        while self.entries and freed < num_blocks:
            (_, salt, tokens), entry = self.entries.popitem(last=False)
            if self.on_reclaim is not None:
                self.on_reclaim(salt, list(tokens), entry)
            self.lengths[entry.num_tokens] -= 1
            if not self.lengths[entry.num_tokens]:
                del self.lengths[entry.num_tokens]
            before = self.allocator.num_free
            for t in entry.block_tables:
                self.allocator.decref(t)
            freed += self.allocator.num_free - before
        return freed

    @property
    def num_blocks_held(self) -> int:
        return len({b for e in self.entries.values() for t in e.block_tables for b in t})
