"""CompressedContexts (a mixin of the KVCacheManager): compressed prompts (kvzip with `reuse`) offered to later
requests that start with them (kv/compressed_prefixes.py), the only sharing under an evicting policy, which turns the
prefix tree off; with a KV connector they also go to the tiers and come back from them (kv/transfers.py).
"""
from __future__ import annotations

from kvforge.kv.compressed_prefixes import CompressedPrefixes


class CompressedContexts:
    """Needs the manager's allocator, block_size, requests, connector, transfers, `compressed`, cache_len and _state."""

    def keep_compressed(self, namespace: str) -> None:
        """Keep compressed contexts (store_compressed) for later prompts that start with them; the prefix tree is
        off under an evicting policy, so this is the only sharing then."""
        self.compressed = CompressedPrefixes(self.allocator, namespace)

    def store_compressed(self, req, policy_state) -> bool:
        """Offer req's compressed prompt (every cached row, whole blocks only) to later requests; False when its
        rows do not fill whole blocks or it holds more than its prompt."""
        rows, n = self.cache_len(req), req.num_computed_tokens
        if self.compressed is None or rows % self.block_size or n != len(req.prompt_token_ids):
            return False
        state = self.requests[req.request_id]
        tables = [t[: rows // self.block_size] for t in state.block_tables]
        if self.compressed.store(req.cache_salt, req.prompt_token_ids, tables, rows, policy_state) and self.connector:
            self.connector.on_compressed(self.compressed.namespace, req.prompt_token_ids, req.cache_salt, rows,
                                         policy_state, tables[0], compressed=True)
        return True

    def _match_compressed(self, req) -> int:
        entry = self.compressed.match(req.cache_salt, req.token_ids)
        if entry is None:
            if self.connector is not None:
                self.transfers.start_compressed_load(req)
            return req.num_computed_tokens
        return self.adopt_compressed(req, entry)

    def adopt_compressed(self, req, entry) -> int:
        """req holds a kept compressed context (kvforge.kv.compressed_prefixes.CompressedPrefix) as its first tokens."""
        state = self._state(req)
        state.block_tables, state.policy_state = self.compressed.adopt(entry)
        state.num_evicted = entry.num_tokens - entry.rows
        state.num_matched = state.num_adopted = entry.num_tokens
        return entry.num_tokens
