"""Attention statistics for policies, taken from the attention the engine computes anyway.

A step that needs them carries an AttentionStats in its metadata: `rows` = {batch row: k} asks for
the attention of the last k queries of that sequence; attention adds them, summed over heads and
layers, into `sums[row]` as [k, context_len]. Decode rows reuse the explicit softmax of the decode
path; prefill rows (which attend through SDPA) get their last k rows recomputed explicitly.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionStats:
    rows: dict[int, int]  # batch row -> trailing queries whose attention a KV policy wants
    sums: dict[int, torch.Tensor] = field(default_factory=dict)  # row -> [k, context_len]

    def add(self, row: int, attn: torch.Tensor) -> None:
        prev = self.sums.get(row)
        self.sums[row] = attn if prev is None else prev + attn


def record_decode(stats: AttentionStats, rows: list[int], probs_sum: torch.Tensor, context_lens: list[int]) -> None:
    """probs_sum: [len(rows), padded keys], the decode softmax of those rows summed over one layer's heads."""
    for r, i in enumerate(rows):
        if stats.rows.get(i):
            stats.add(i, probs_sum[r, : context_lens[i]][None].float())


def record_multi(stats: AttentionStats, rows: list[int], probs_sum: torch.Tensor, query_lens: list[int],
                 context_lens: list[int]) -> None:
    """probs_sum: [len(rows), M, padded keys] for rows of a few queries each, summed over one layer's heads."""
    for r, i in enumerate(rows):
        k = stats.rows.get(i, 0)
        if k:
            n = query_lens[i]
            stats.add(i, probs_sum[r, n - k: n, : context_lens[i]].float())


def record_prefill(stats: AttentionStats, row: int, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor,
                   scale: float) -> None:
    """q: [n, heads, d]; k: [1, kv_heads, ctx, d]; mask: [n, ctx] (True = attend)."""
    rows = stats.rows.get(row, 0)
    if not rows:
        return
    qt = q[-rows:].float()
    kk = k[0].repeat_interleave(q.shape[1] // k.shape[1], dim=0)  # [heads, ctx, d]
    scores = torch.einsum("rhd,hcd->hrc", qt, kk) * scale
    probs = torch.softmax(scores.masked_fill(~mask[-rows:], float("-inf")), dim=-1)
    stats.add(row, probs.sum(0))
