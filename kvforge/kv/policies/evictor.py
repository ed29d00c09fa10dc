"""Evictor: applies the engine's KVPolicy to each step's sequences (statistics in, compaction out)."""
from __future__ import annotations

import time
from dataclasses import fields, replace

import torch

from kvforge.errors import ConfigError
from kvforge.kv.policies.base import KVPolicy, PolicyState, SequenceView
from kvforge.kv.policies.compact import compact, full_attention_layers
from kvforge.kv.policies.head_roles import load_roles
from kvforge.kv.policies.keys import key_rows
from kvforge.kv.policies.placement import in_place
from kvforge.kv.policies.stats import AttentionStats
from kvforge.kv.policies.values import value_norms


class Evictor:
    def __init__(self, policy: KVPolicy, kv, rotary=None, reconstruct=None, model_path: str | None = None,
                 inv_freq: torch.Tensor | None = None):
        self.policy, self.kv = policy, kv
        self.roles = None if policy.heads is None else load_roles(
            policy.heads, model_path, policy.retrieval_heads, policy.streaming_heads,
            len(full_attention_layers(kv)), kv.spec.num_kv_heads)
        # retrieval heads keep by score alone: the same policy without its recent window
        has_recent = any(f.name == "recent" for f in fields(policy))
        self.by_score = replace(policy, recent=0.0, heads=None) if self.roles is not None and has_recent else None
        self.reconstruct = reconstruct  # (seq, policy) -> scores of a scoring pass (kvzip; the engine's runner)
        if policy.reconstructs and reconstruct is None:
            raise ConfigError(f"kv_policy {policy.name!r} runs a scoring pass of its own; it needs the engine's runner")
        self.rotary = rotary if policy.rope_by_cache_index else None
        # for policies that turn queries to future positions (a model without RoPE gives zeros: nothing turns)
        self.inv_freq = inv_freq if inv_freq is not None else getattr(rotary, "inv_freq", None)
        if policy.needs_queries and self.inv_freq is None:
            raise ConfigError(f"kv_policy {policy.name!r} needs the model's RoPE frequencies; this model has none")
        self.drop_unit = kv.format.drop_unit(kv.spec, kv.block_size)  # whole blocks where rows share parameters
        self.in_place = policy.places_in_place and self.roles is None and not policy.reuses_prefixes
        self.evicted_tokens = 0
        self.compactions = 0
        self.compact_seconds = 0.0

    def view(self, seq) -> SequenceView:
        return SequenceView(self.kv.cache_len(seq), seq.num_computed_tokens, len(seq.prompt_token_ids),
                            self.kv.policy_state(seq, PolicyState))

    def tokens_before_compaction(self, seq, limit: int) -> int:
        """How many more tokens seq can compute (at most limit) before its cache must be compacted, so a
        multi-token step (speculation) compacts exactly where token-by-token decoding would."""
        view = self.view(seq)
        for j in range(1, limit):
            after = SequenceView(view.cache_len + j, view.num_computed_tokens + j, view.prompt_len, view.state)
            if self.policy.should_compact(after):
                return j
        return limit

    def positions(self, seq, num_new: int) -> range:
        """RoPE positions of the new tokens: their logical positions. For policies that see cache-index
        distances (streaming) that is cache index + tokens dropped, and compaction turns the keys whose
        distance changes (see compact)."""
        return range(seq.num_computed_tokens, seq.num_computed_tokens + num_new)

    def stats_request(self, seqs, num_new: list[int], num_drafts: list[int] | None = None) -> AttentionStats | None:
        """What attention this step must record: how many trailing query rows of each sequence (num_drafts: how many
        of each one's new tokens are drafts, which verification may reject)."""
        if not self.policy.needs_attention:
            return None
        rows = {i: self.policy.attention_rows(self.view(s), n) for i, (s, n) in enumerate(zip(seqs, num_new))}
        rows = {i: r for i, r in rows.items() if r}
        if not rows:
            return None
        if not self.policy.per_layer:
            return AttentionStats(rows, query_heads=self.policy.query_heads)
        if self.policy.needs_queries:
            return AttentionStats(rows, per_layer=True, settled=dict(rows), wants_queries=True)
        if self.policy.max_over_queries:
            return AttentionStats(rows, per_layer=True, settled=dict(rows), query_heads=self.policy.query_heads,
                                  max_queries=True)  # attention summed early
        # queries that are not drafts are never rolled back: a policy that only sums queries sums them at once
        drafts = num_drafts or [0] * len(seqs)
        settled = {i: max(0, r - drafts[i]) for i, r in rows.items()} if self.policy.sums_queries else {}
        return AttentionStats(rows, per_layer=True, settled=settled, query_heads=self.policy.query_heads)

    def after_step(self, seqs, stats: AttentionStats | None, rejected: dict[str, int] | None = None) -> None:
        """Feed the step's attention to each sequence's state (rows and keys of rejected drafts left out),
        then compact the ones over budget."""
        for i, seq in enumerate(seqs):
            view = self.view(seq)
            if self.policy.reconstructs and self.policy.wants_scoring(view):
                view.state.pending = True
                self.policy.observe(view.state, self.reconstruct(seq, self.policy))
                view = self.view(seq)
            cut = (rejected or {}).get(seq.request_id, 0)
            if stats is not None and stats.per_layer:
                found = stats.layer_attention(i, cut, per_head=self.policy.scope == "head")
                if found is not None:
                    if self.policy.weighs_values:
                        self._record_values(seq, view.state, found[0].shape[-1], found[1])
                    self.policy.observe(view.state, *found)
                if self.policy.needs_queries and i in stats.queries:
                    queries = torch.stack(stats.queries[i]).transpose(1, 2)  # [layers, heads, k, dim]
                    keep_rows = queries.shape[2] - cut
                    if keep_rows > 0:
                        self.policy.observe_queries(view.state, queries[:, :, :keep_rows],
                                                    stats.query_positions[i][:keep_rows], self.inv_freq)
            elif stats is not None and i in stats.sums:
                attn = stats.sums[i]
                attn = attn[: attn.shape[0] - cut, : attn.shape[1] - cut] if attn.shape[0] > cut else None
                if attn is not None:
                    self.policy.observe(view.state, attn / attn.sum(-1, keepdim=True))
            if self.policy.weighs_values:
                self._record_values(seq, view.state, view.cache_len, 0)
            if self.policy.reads_keys and self.policy.should_compact(view):
                view.state.keys = key_rows(self.kv, seq, view.cache_len)
            keep = self.policy.keep(view, 1 if self.in_place else self.drop_unit)  # in place, nothing shifts
            if keep is None:
                continue
            if self.in_place:
                keep = in_place(keep, keep.shape[-1] // self.drop_unit * self.drop_unit)
            if self.policy.reuses_prefixes:
                keep = self._whole_blocks(keep, view)
            if self.roles is not None:
                alone = None if self.by_score is None else self.by_score.select(view.cache_len, keep.shape[-1], view.state)
                keep = self.roles.apply(keep, view.cache_len, alone)
            start = time.perf_counter()
            view.state.grow(view.cache_len)
            self.evicted_tokens += compact(self.kv, seq, keep, self.rotary, whole_blocks=self.in_place)
            view.state.compact(keep)
            self.compactions += 1
            self.compact_seconds += time.perf_counter() - start
            if self.policy.reuses_prefixes:
                self.kv.store_compressed(seq, view.state)

    def _whole_blocks(self, keep: torch.Tensor, view: SequenceView) -> torch.Tensor:
        """keep with its count rounded up to whole blocks (the policy's next best rows), so shared blocks are full."""
        m, bs = keep.shape[-1], self.kv.block_size
        whole = min(view.cache_len, -(-m // bs) * bs)
        return keep if whole == m else self.policy.select(view.cache_len, whole, view.state)

    def _record_values(self, seq, state: PolicyState, length: int, fresh: int) -> None:
        """Value norms of the rows not yet recorded and of the `fresh` last rows (this step's, maybe rewritten)."""
        start = min(state.values_known(length), length - fresh)
        if start < length:
            state.set_values(start, value_norms(self.kv, seq, start, length))

    def stats(self) -> dict:
        return {"kv_policy": self.policy.name, "kv_policy_budget": self.policy.budget,
                "kv_evicted_tokens": self.evicted_tokens, "kv_compactions": self.compactions,
                "kv_compact_seconds": self.compact_seconds}
