"""Attention over the paged KV cache (torch reference, device-agnostic).

Each layer attends with `meta.for_layer(layer)`: the view of its KV group (kv/groups.py). A sliding-window
group's view starts each block table at the first block inside the window, with context lengths counted
from there, so the blocks it freed behind the window are never read.

Queries of one step are flattened across sequences: sequence i owns rows
query_start_loc[i] : query_start_loc[i] + query_lens[i]. Its keys are the first
context_lens[i] slots of the blocks in block_tables[i] (the new tokens included:
they were written to the cache before attention runs). What every layer needs alike (padded
block tables, masks, block-id tensors) is built once per step, on the first layer's use.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvforge.kv.layer_format import LayerKV
from kvforge.kv.policies.stats import AttentionStats, record_multi, record_prefill, record_queries, reduce_query_heads
from kvforge.ops import paged_attend, paged_decode

DECODE_BUCKETS = 4
MULTI_QUERY_MAX = 8  # rows of 2..8 queries (speculative verification, short chunks) attend batched, not one by one


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat cache slot of each new token
    positions: torch.Tensor  # [T] rotary position of each new token
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    block_size: int
    sliding_window: int | None = None
    stats: AttentionStats | None = None  # attention rows a KV policy asked for, filled by attend
    layer_views: list[AttentionMetadata] | None = None  # per model layer: its KV group's view (None = self for all)
    state_slots: list[int] | None = None  # per sequence: its recurrent state slot (recurrent layers, kv/state_pool.py)
    state_cuts: list[list[int]] | None = None  # per sequence: after how many of its new tokens to copy the state
    query_start_loc: list[int] = field(init=False)
    decode_rows: list[int] = field(init=False)  # sequences with one query token
    multi_rows: list[int] = field(init=False)  # sequences with 2..MULTI_QUERY_MAX query tokens
    prefill_rows: list[int] = field(init=False)

    def __post_init__(self):
        starts, total = [], 0
        for n in self.query_lens:
            starts.append(total)
            total += n
        self.query_start_loc = starts
        self.decode_rows = [i for i, n in enumerate(self.query_lens) if n == 1]
        self.multi_rows = [i for i, n in enumerate(self.query_lens) if 1 < n <= MULTI_QUERY_MAX]
        self.prefill_rows = [i for i, n in enumerate(self.query_lens) if n > MULTI_QUERY_MAX]
        self._groups_cache = None
        self._one_query_cache = None
        self._all_decode_cache = None
        self._multi_cache = None
        self._short_cache = None
        self._prefill_cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def for_layer(self, layer: int) -> AttentionMetadata:
        """The metadata layer `layer` writes and attends with: its KV group's slots, block tables and context
        lengths, and its own sliding window (built once per step, shared by the layers of that group)."""
        return self.layer_views[layer] if self.layer_views is not None else self

    def decode_groups(self, device) -> list[tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Decode rows bucketed by length (rows, table, mask, query index, context lengths), so short rows are not
        padded to long ones."""
        if self._groups_cache is None:
            rows = sorted(self.decode_rows, key=lambda i: len(self.block_tables[i]))
            size = max(8, -(-len(rows) // DECODE_BUCKETS))
            self._groups_cache = [(part, *self._layout(part, device))
                                  for part in (rows[s: s + size] for s in range(0, len(rows), size))]
        return self._groups_cache

    def one_query_groups(self, device) -> list[tuple]:
        """decode_groups shaped as rows of M = 1 queries (mask [B, 1, keys], query index and lengths [B, 1])."""
        if self._one_query_cache is None:
            self._one_query_cache = [(rows, table, valid[:, None], q_index[:, None], ctx[:, None])
                                     for rows, table, valid, q_index, ctx in self.decode_groups(device)]
        return self._one_query_cache

    def all_decode(self, device) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """Every decode row in one batch for the compiled operator, which walks each row's own length (no
        bucketing): (query index, None when the decode rows are all rows in order; block table; lengths)."""
        if self._all_decode_cache is None:
            rows = self.decode_rows
            table = self._padded_table(rows)
            lens = torch.tensor([self.context_lens[i] for i in rows], dtype=torch.long)
            identity = len(rows) == len(self.query_lens)
            q_index = None if identity else torch.tensor([self.query_start_loc[i] for i in rows], device=device)
            self._all_decode_cache = q_index, table.to(device), lens
        return self._all_decode_cache

    def all_short(self, device) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every decode and multi-query row in one batch for the compiled multi-query operator: (query index, None
        when those rows are all rows in order; query starts [B + 1]; block table [B, W]; lengths [B])."""
        if self._short_cache is None:
            rows = sorted(self.decode_rows + self.multi_rows)
            counts = [self.query_lens[i] for i in rows]
            table = self._padded_table(rows)
            starts = torch.tensor([0] + counts, dtype=torch.long).cumsum(0)
            lens = torch.tensor([self.context_lens[i] for i in rows], dtype=torch.long)
            identity = len(rows) == len(self.query_lens)
            q_index = None if identity else torch.cat(
                [torch.arange(self.query_start_loc[i], self.query_start_loc[i] + n) for i, n in zip(rows, counts)])
            self._short_cache = None if q_index is None else q_index.to(device), starts, table.to(device), lens
        return self._short_cache

    def _padded_table(self, rows: list[int]) -> torch.Tensor:
        """The rows' block tables as one [B, W] tensor, shorter ones padded with block 0 (masked by length)."""
        width = max(len(self.block_tables[i]) for i in rows)
        return torch.tensor([self.block_tables[i] + [0] * (width - len(self.block_tables[i])) for i in rows],
                            dtype=torch.long)

    def _layout(self, rows: list[int], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        table = self._padded_table(rows)
        width = table.shape[1]
        ctx = torch.tensor([self.context_lens[i] for i in rows])
        key_pos = torch.arange(width * self.block_size)
        valid = key_pos[None, :] < ctx[:, None]
        if self.sliding_window:
            valid &= key_pos[None, :] >= (ctx[:, None] - self.sliding_window)
        q_index = torch.tensor([self.query_start_loc[i] for i in rows])
        return table.to(device), valid.to(device), q_index.to(device), ctx

    def multi_groups(self, device) -> list[tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Rows of a few queries in one padded batch: (rows, table [B, W], mask [B, M, keys], query index [B, M],
        keys each query sees [B, M]).
        Query j of a row sees its causal prefix; rows shorter than M repeat their last query (same result)."""
        if self._multi_cache is None and self.multi_rows:
            rows = self.multi_rows
            width = max(len(self.block_tables[i]) for i in rows)
            m = max(self.query_lens[i] for i in rows)
            table = torch.zeros(len(rows), width, dtype=torch.long)
            q_index = torch.zeros(len(rows), m, dtype=torch.long)
            q_ctx = torch.zeros(len(rows), m, dtype=torch.long)
            for r, i in enumerate(rows):
                table[r, : len(self.block_tables[i])] = torch.tensor(self.block_tables[i])
                j = torch.arange(m).clamp(max=self.query_lens[i] - 1)
                q_index[r] = self.query_start_loc[i] + j
                q_ctx[r] = self.context_lens[i] - self.query_lens[i] + 1 + j
            key_pos = torch.arange(width * self.block_size)
            valid = key_pos[None, None, :] < q_ctx[:, :, None]
            if self.sliding_window:
                valid &= key_pos[None, None, :] >= (q_ctx[:, :, None] - self.sliding_window)
            self._multi_cache = [(rows, table.to(device), valid.to(device), q_index.to(device), q_ctx)]
        return self._multi_cache or []

    def prefill_layout(self, i: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill row i's history block ids and its [queries, context_len] causal mask (sliding window included)."""
        if i not in self._prefill_cache:
            n, ctx = self.query_lens[i], self.context_lens[i]
            blocks = torch.tensor(self.block_tables[i][: -(-ctx // self.block_size)], device=device)
            qpos = torch.arange(ctx - n, ctx, device=device)[:, None]
            kpos = torch.arange(ctx, device=device)[None, :]
            mask = kpos <= qpos
            if self.sliding_window:
                mask &= kpos > qpos - self.sliding_window
            self._prefill_cache[i] = blocks, mask
        return self._prefill_cache[i]


def attend(q: torch.Tensor, cache: LayerKV, meta: AttentionMetadata, scale: float,
           softcap: float | None = None) -> torch.Tensor:
    """q: [T, heads, dim] -> [T, heads, v_dim] attention output over the cached history. `softcap` (Gemma 2's
    attn_logit_softcapping) bounds the scaled scores to softcap * tanh(scores / softcap); the compiled operators
    have no soft-capping, so such layers run the torch path, as do KV policies (they read probabilities)."""
    out = None
    if meta.stats is not None and meta.stats.wants_queries:
        record_queries(meta.stats, q, meta.query_start_loc, meta.query_lens, meta.positions)
    compiled = _short_rows_compiled(q, cache, meta, scale) if not (meta.stats or softcap) else None
    if compiled is not None:
        q_index, dec = compiled
        if q_index is None:
            return dec
        out = q.new_empty(q.shape[0], q.shape[1], dec.shape[-1])
        out[q_index] = dec
    groups = [] if compiled else meta.one_query_groups(q.device) + meta.multi_groups(q.device)
    for rows, table, valid, q_index, q_ctx in groups:
        dec = _decode(q, cache, meta, scale, rows, table, valid, q_index, q_ctx, softcap)
        if out is None:
            out = q.new_empty(q.shape[0], q.shape[1], dec.shape[-1])
        out[q_index.flatten()] = dec
    for i in meta.prefill_rows:
        start, n = meta.query_start_loc[i], meta.query_lens[i]
        res = _prefill_one(q[start : start + n], cache, meta, i, scale, softcap)
        if out is None:
            out = q.new_empty(q.shape[0], q.shape[1], res.shape[-1])
        out[start : start + n] = res
    return out


def _short_rows_compiled(q: torch.Tensor, cache: LayerKV, meta: AttentionMetadata,
                         scale: float) -> tuple[torch.Tensor | None, torch.Tensor] | None:
    """Every decode and multi-query row through one compiled operator call: (their query index, None when they are
    all rows in order; their output), or None when there are none or no compiled kernel for this cache."""
    if meta.multi_rows:
        q_index, starts, table, lens = meta.all_short(q.device)
        out = paged_attend(q if q_index is None else q[q_index], cache, starts, table, lens, scale, meta.sliding_window)
    elif meta.decode_rows:
        q_index, table, lens = meta.all_decode(q.device)
        out = paged_decode(q if q_index is None else q[q_index], cache, table, lens, scale, meta.sliding_window)
    else:
        return None
    return None if out is None else (q_index, out)


def _decode(q: torch.Tensor, cache: LayerKV, meta: AttentionMetadata, scale: float, rows: list[int],
            table: torch.Tensor, valid: torch.Tensor, q_index: torch.Tensor, q_ctx: torch.Tensor,
            softcap: float | None = None) -> torch.Tensor:
    """Rows of M queries each (M = 1 for plain decode), padded into one batch: valid [B, M, keys], q_index and
    q_ctx (keys each query sees) [B, M] -> [B * M, heads, v_dim] in q_index order."""
    b, width = table.shape
    m = q_index.shape[1]
    k, v = cache.gather(table.flatten())
    kv_heads, length = k.shape[1], width * meta.block_size
    k, v = k.view(b, length, kv_heads, -1), v.view(b, length, kv_heads, -1)
    group = q.shape[1] // kv_heads
    qd = q[q_index.flatten()].view(b, m, kv_heads, group, q.shape[-1])
    mask = ~valid.repeat_interleave(group, dim=1)  # [B, M * group, keys]
    out, per_head = [], []
    for h in range(kv_heads):
        scores = _cap(torch.bmm(qd[:, :, h].reshape(b, m * group, -1), k[:, :, h].transpose(1, 2)) * scale, softcap)
        probs = torch.softmax(scores.masked_fill_(mask, float("-inf")), dim=-1)
        out.append(torch.bmm(probs, v[:, :, h]).view(b, m, group, -1))
        if meta.stats:
            per_head.append(reduce_query_heads(meta.stats, probs.view(b, m, group, -1), 2))
    if per_head:
        record_multi(meta.stats, rows, torch.stack(per_head, 1), meta.query_lens, meta.context_lens)
    return torch.stack(out, 2).reshape(b * m, q.shape[1], -1)


def prefill_history(cache: LayerKV, meta: AttentionMetadata, i: int,
                    device) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Sequence i's cached K and V (V None for MLA) as [1, kv_heads, context_len, dim], and its
    [queries, context_len] causal mask (sliding window included)."""
    ctx = meta.context_lens[i]
    blocks, mask = meta.prefill_layout(i, device)
    k, v = cache.gather(blocks)
    k, v = (x[:ctx].transpose(0, 1)[None] if x is not None else None for x in (k, v))
    return k, v, mask


def _cap(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return scores if not softcap else torch.tanh(scores / softcap) * softcap


def _prefill_one(q: torch.Tensor, cache: LayerKV, meta: AttentionMetadata, i: int, scale: float,
                 softcap: float | None = None) -> torch.Tensor:
    k, v, mask = prefill_history(cache, meta, i, q.device)
    qh = q.transpose(0, 1)[None]
    if softcap:  # scaled_dot_product_attention has no soft-capping: scores written out
        group = q.shape[1] // k.shape[1]
        kq, vq = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = _cap(qh @ kq.transpose(-1, -2) * scale, softcap).masked_fill_(~mask, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ vq
    else:
        out = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    if meta.stats:
        record_prefill(meta.stats, i, q, k, mask, scale)
    return out[0].transpose(0, 1)
