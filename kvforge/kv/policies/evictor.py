"""Evictor: applies the engine's KVPolicy to each step's sequences (statistics in, compaction out)."""
from __future__ import annotations

import time

from kvforge.kv.policies.base import KVPolicy, PolicyState
from kvforge.kv.policies.compact import compact


class Evictor:
    def __init__(self, policy: KVPolicy, kv, rotary=None):
        self.policy, self.kv = policy, kv
        self.rotary = rotary if policy.rope_by_cache_index else None
        self.evicted_tokens = 0
        self.compactions = 0
        self.compact_seconds = 0.0

    def positions(self, seq, num_new: int) -> range:
        """RoPE positions of the new tokens: cache indices (streaming) or logical positions."""
        base = seq.cache_len if self.policy.rope_by_cache_index else seq.num_computed_tokens
        return range(base, base + num_new)

    def collect(self, seqs, num_new: list[int]) -> dict[int, int] | None:
        """meta.collect for a step: how many trailing query rows of each sequence need attention rows."""
        if not self.policy.needs_attention:
            return None
        rows = {i: self.policy.attention_rows(s, n) for i, (s, n) in enumerate(zip(seqs, num_new))}
        return {i: r for i, r in rows.items() if r} or None

    def after_forward(self, seqs, meta) -> None:
        """Feed the step's attention to each sequence's state, then compact the ones over budget."""
        sums = getattr(meta, "attn_sums", {})
        for i, seq in enumerate(seqs):
            if seq.policy_state is None:
                seq.policy_state = PolicyState()
            state = seq.policy_state
            attn = sums.get(i)
            if attn is not None:
                self.policy.observe(state, attn / attn.sum(-1, keepdim=True))
            keep = self.policy.keep(seq, state)
            if keep is None:
                continue
            start = time.perf_counter()
            state.grow(seq.cache_len)
            self.evicted_tokens += compact(self.kv, seq, keep, self.rotary)
            state.compact(keep)
            self.compactions += 1
            self.compact_seconds += time.perf_counter() - start

    def stats(self) -> dict:
        return {"kv_policy": self.policy.name, "kv_policy_budget": self.policy.budget,
                "kv_evicted_tokens": self.evicted_tokens, "kv_compactions": self.compactions,
                "kv_compact_seconds": self.compact_seconds}
