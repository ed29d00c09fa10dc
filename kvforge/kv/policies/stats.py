"""Attention statistics for policies, taken from the attention the engine computes anyway.

A step asks for them with meta.collect = {row: k}: the attention of the last k queries of sequence
`row`, summed over heads and layers, lands in meta.attn_sums[row] as [k, context_len].
Decode rows reuse the explicit softmax of the decode path; prefill rows (which attend through SDPA)
get their last k rows recomputed explicitly.
"""
from __future__ import annotations

import torch


def _add(meta, row: int, attn: torch.Tensor) -> None:
    prev = meta.attn_sums.get(row)
    meta.attn_sums[row] = attn if prev is None else prev + attn


def record_decode(meta, rows: list[int], probs_sum: torch.Tensor) -> None:
    """probs_sum: [len(rows), padded keys], the decode softmax of those rows summed over one layer's heads."""
    for r, i in enumerate(rows):
        if meta.collect.get(i):
            _add(meta, i, probs_sum[r, : meta.context_lens[i]][None].float())


def record_prefill(meta, row: int, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, scale: float) -> None:
    """q: [n, heads, d]; k: [1, kv_heads, ctx, d]; mask: [n, ctx] (True = attend)."""
    rows = meta.collect.get(row, 0)
    if not rows:
        return
    qt = q[-rows:].float()
    kk = k[0].repeat_interleave(q.shape[1] // k.shape[1], dim=0)  # [heads, ctx, d]
    scores = torch.einsum("rhd,hcd->hrc", qt, kk) * scale
    probs = torch.softmax(scores.masked_fill(~mask[-rows:], float("-inf")), dim=-1)
    _add(meta, row, probs.sum(0))
