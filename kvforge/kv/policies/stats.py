"""Attention statistics for policies, taken from the attention the engine computes anyway.

A step that needs them carries an AttentionStats in its metadata: `rows` = {batch row: k} asks for
the attention of the last k queries of that sequence. Each full-attention layer records each asked row
once, in layer order, as [kv_heads, k, context_len] (query heads summed within their KV head).
Decode rows reuse the explicit softmax of the decode path; prefill rows (which attend through SDPA)
get their last k rows recomputed explicitly.

- Sequence scope (`per_layer` False): `sums[row]` adds every layer and head up, [k, context_len].
- Per-layer scope: `layers[row]` keeps one entry per layer, each (KV head, query) row normalized to sum 1.
- `query_heads`: how the query heads of one KV head combine: "sum" (their softmax rows added) or "max"
  (each key's largest probability over them, so a key one head needs is not outvoted by the others).
  The first `settled[row]` queries of a row (never rolled back: they are not drafts) are summed as they
  arrive, so a long prefill chunk costs [kv_heads, context_len] per layer; the others stay one by one.
- `max_queries` (kvzip): each key's largest probability over the asked queries, not renormalized, folded on
  arrival as the settled entry (so a scoring pass over thousands of queries costs [kv_heads, context_len]).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionStats:
    rows: dict[int, int]  # batch row -> trailing queries whose attention a KV policy wants
    per_layer: bool = False
    query_heads: str = "sum"  # "sum" or "max" over the query heads of a KV head (see reduce_query_heads)
    settled: dict[int, int] = field(default_factory=dict)  # row -> leading queries summed on arrival (per layer)
    sums: dict[int, torch.Tensor] = field(default_factory=dict)  # row -> [k, context_len] (sequence scope)
    layers: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    wants_queries: bool = False  # also record the asked rows' queries (after RoPE) per layer (expected_attention)
    queries: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # row -> per layer [k, heads, dim]
    query_positions: dict[int, torch.Tensor] = field(default_factory=dict)  # row -> [k] their RoPE positions
    max_queries: bool = False  # per layer: the max over the asked queries instead of their sum (kvzip)

    def add(self, row: int, attn: torch.Tensor) -> None:
        """attn: [kv_heads, k, context_len], one layer's attention of row's asked queries."""
        if not self.per_layer:
            attn = attn.sum(0)
            prev = self.sums.get(row)
            self.sums[row] = attn if prev is None else prev + attn
            return
        if self.max_queries:
            self.layers.setdefault(row, []).append((attn.amax(1), attn[:, :0]))
            return
        attn = attn / attn.sum(-1, keepdim=True)
        s = self.settled.get(row, 0)
        self.layers.setdefault(row, []).append((attn[:, :s].sum(1), attn[:, s:]))

    def layer_attention(self, row: int, cut: int = 0, per_head: bool = True) -> tuple[torch.Tensor, int] | None:
        """Row's attention per layer as [layers, heads, r, keys] with the settled queries as one summed first
        row, and the number of queries it stands for; the last `cut` queries and keys (rejected drafts) left
        out. per_head False sums the KV heads (heads = 1). None when nothing is left."""
        entries = self.layers.get(row)
        if not entries:
            return None
        summed = torch.stack([s for s, _ in entries])  # [L, H, keys]
        each = torch.stack([r for _, r in entries])  # [L, H, k - s, keys]
        num_summed, num_each = self.settled.get(row, 0), each.shape[2] - cut
        if num_summed + num_each <= 0:
            return None
        keys = summed.shape[-1] - cut
        parts = ([summed[..., None, :keys]] if num_summed else []) + [each[:, :, :max(0, num_each), :keys]]
        attn = torch.cat(parts, dim=2)
        if not per_head:
            attn = attn.sum(1, keepdim=True)
        return attn, num_summed + max(0, num_each)


def record_queries(stats: AttentionStats, q: torch.Tensor, query_start_loc: list[int], query_lens: list[int],
                   positions: torch.Tensor) -> None:
    """q: [T, heads, dim], one layer's queries after RoPE; keeps the asked trailing rows of each sequence."""
    for i, k in stats.rows.items():
        end = query_start_loc[i] + query_lens[i]
        stats.queries.setdefault(i, []).append(q[end - k: end].float().cpu())
        if i not in stats.query_positions:
            stats.query_positions[i] = positions[end - k: end].cpu()


def reduce_query_heads(stats: AttentionStats, probs: torch.Tensor, dim: int) -> torch.Tensor:
    """probs with the query heads of each KV head along `dim` -> summed or max-reduced over them."""
    return probs.amax(dim) if stats.query_heads == "max" else probs.sum(dim)


def record_decode(stats: AttentionStats, rows: list[int], probs_sum: torch.Tensor, context_lens: list[int]) -> None:
    """probs_sum: [len(rows), padded keys], the decode softmax of those rows reduced over one layer's heads
    (MLA: one latent KV head)."""
    for r, i in enumerate(rows):
        if stats.rows.get(i):
            stats.add(i, probs_sum[r, None, None, : context_lens[i]].float())


def record_multi(stats: AttentionStats, rows: list[int], probs: torch.Tensor, query_lens: list[int],
                 context_lens: list[int]) -> None:
    """probs: [len(rows), kv_heads, M, padded keys] for rows of a few queries each, query heads reduced per KV head."""
    for r, i in enumerate(rows):
        k = stats.rows.get(i, 0)
        if k:
            n = query_lens[i]
            stats.add(i, probs[r, :, n - k: n, : context_lens[i]].float())


def record_prefill(stats: AttentionStats, row: int, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor,
                   scale: float) -> None:
    """q: [n, heads, d]; k: [1, kv_heads, ctx, d]; mask: [n, ctx] (True = attend)."""
    rows = stats.rows.get(row, 0)
    if not rows:
        return
    qt = q[-rows:].float()
    kv_heads = k.shape[1]
    kk = k[0].float().repeat_interleave(q.shape[1] // kv_heads, dim=0)  # [heads, ctx, d]
    scores = torch.einsum("rhd,hcd->hrc", qt, kk) * scale
    probs = torch.softmax(scores.masked_fill(~mask[-rows:], float("-inf")), dim=-1)
    stats.add(row, reduce_query_heads(stats, probs.unflatten(0, (kv_heads, -1)), 1))
