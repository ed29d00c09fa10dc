"""Torch references of kvforge::paged_decode and kvforge::paged_attend: decode the listed blocks with the formats' own codecs, lay the
exact rows over them, and attend with a causal/window mask (the math of attention.py's decode path)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvforge.kv.quant.overlay import overlay_exact
from kvforge.kv.quant.scaled import ScaledCodec
from kvforge.kv.quant.uniform import UniformCodec

KINDS = {"plain": 0, "scaled": 1, "uniform_token": 2, "uniform_channel": 3}
CODEC_PARTS = 6  # uniform parts after these (the scale table) are not per block


def decode_side(meta: list[int], parts: list[torch.Tensor], blocks: torch.Tensor) -> torch.Tensor:
    """fp32 [len(blocks), block_size, kv_heads, dim] of one side (K or V) as stored."""
    kind, bits, group = meta
    picked = [p.index_select(0, blocks) for p in parts[:CODEC_PARTS] if p.numel()]
    if kind == KINDS["plain"]:
        return picked[0].float()
    if kind == KINDS["scaled"]:
        return ScaledCodec(parts[0].dtype).decode(picked)
    axis = "token" if kind == KINDS["uniform_token"] else "channel"
    return UniformCodec(bits, axis, group, param_bits=8 if parts[1].dtype == torch.uint8 else 16).decode(picked)


def paged_decode(q: torch.Tensor, block_table: torch.Tensor, context_lens: torch.Tensor, scale: float, window: int,
                 k_meta: list[int], k_parts: list[torch.Tensor], v_meta: list[int], v_parts: list[torch.Tensor],
                 stage: list[torch.Tensor], sink: list[torch.Tensor]) -> torch.Tensor:
    """q [B, heads, dim]; sequence b attends to its first context_lens[b] slots of block_table[b] -> [B, heads, v_dim]."""
    b, width = block_table.shape
    blocks = block_table.flatten().long()
    k, v = decode_side(k_meta, k_parts, blocks), decode_side(v_meta, v_parts, blocks)
    for exact in (stage, sink):
        if exact:
            overlay_exact([k, v], exact[0][blocks].long(), exact[1:])
    length = width * k.shape[1]
    k, v = (x.reshape(b, length, x.shape[2], -1).transpose(1, 2) for x in (k, v))
    pos = torch.arange(length, device=q.device)[None, :]
    ctx = context_lens.to(q.device).long()[:, None]
    valid = pos < ctx
    if window > 0:
        valid &= pos >= ctx - window
    out = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=valid[:, None, None], scale=scale,
                                         enable_gqa=True)
    return out[:, :, 0]


def paged_attend(q: torch.Tensor, query_start: torch.Tensor, block_table: torch.Tensor, context_lens: torch.Tensor,
                 scale: float, window: int, k_meta: list[int], k_parts: list[torch.Tensor], v_meta: list[int],
                 v_parts: list[torch.Tensor], stage: list[torch.Tensor], sink: list[torch.Tensor]) -> torch.Tensor:
    """q [T, heads, dim]; sequence b owns queries query_start[b]:query_start[b + 1], the last of its
    context_lens[b] keys, and query i of them sees the keys up to its own position -> [T, heads, v_dim].
    Each query runs as a decode row over its causal prefix."""
    starts = query_start.long().cpu()
    counts = starts[1:] - starts[:-1]
    seq = torch.repeat_interleave(torch.arange(len(counts)), counts)
    offset = torch.arange(len(seq)) - starts[seq]
    lens = context_lens.long().cpu()[seq] - counts[seq] + 1 + offset
    return paged_decode(q, block_table[seq.to(block_table.device)], lens, scale, window, k_meta, k_parts, v_meta,
                        v_parts, stage, sink)
