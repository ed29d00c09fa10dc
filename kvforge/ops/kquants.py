"""GGUF K-quant super-blocks (Q4_K, Q5_K, Q6_K: 256 weights with 6-/8-bit sub-block scales) as the integer codes
and per-lane scales that ops/qblocks.py's kernels and references compute with.

A super-block's weight j is lane_d[j // 4] * code[j] + lane_m[j // 4], lane = 4 consecutive weights (one VNNI
lane). Q4_K / Q5_K: an fp16 d and dmin, 8 sub-blocks of 32 with a 6-bit scale and min each (12 bytes), unsigned
4-/5-bit codes: lane_d = d * scale, lane_m = -(dmin * min). Q6_K: 16 sub-blocks of 16 with an int8 scale, 6-bit
codes less 32: lane_d = d * scale, no m. The products are gguf's (d * scale, dmin * min, then d * q - dm), so
dequantizing this way is bit-identical to gguf.quants.dequantize.
"""
from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as Q

SUPER = 256  # weights per super-block
K_TYPES = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
LANE = 4  # weights per lane


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()[:, 0]


def _scale_min_k4(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and 8 six-bit mins packed in bytes 4..15 of a Q4_K / Q5_K super-block, [n, 8] each."""
    s = blocks[:, 4:16].to(torch.int32)
    scale = torch.cat((s[:, 0:4] & 63, (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)), dim=1)
    low = torch.cat((s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)), dim=1)
    return scale, low


def codes(blocks: torch.Tensor, qtype: Q) -> torch.Tensor:
    """[n, block_bytes] uint8 super-blocks -> their signed codes [n, 256] int32 (Q6_K's less its offset 32)."""
    n = blocks.shape[0]
    if qtype == Q.Q6_K:
        ql = blocks[:, :128].reshape(n, 2, 64)
        qh = blocks[:, 128:192].reshape(n, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]
        low = torch.stack((ql[..., :32] & 0xF, ql[..., 32:] & 0xF, ql[..., :32] >> 4, ql[..., 32:] >> 4), dim=2)
        return (low | ((qh & 3) << 4)).reshape(n, SUPER).to(torch.int32) - 32
    qs = blocks[:, 16:144].reshape(n, 4, 1, 32) if qtype == Q.Q4_K else blocks[:, 48:176].reshape(n, 4, 1, 32)
    q = ((qs >> torch.tensor([0, 4], dtype=torch.uint8)[:, None]) & 0xF).reshape(n, 8, 32).to(torch.int32)
    if qtype == Q.Q5_K:
        fifth = (blocks[:, None, 16:48] >> torch.arange(8, dtype=torch.uint8)[:, None]) & 1  # sub-block i: bit i
        q = q | (fifth.to(torch.int32) << 4)
    return q.reshape(n, SUPER)


def lane_scales(blocks: torch.Tensor, qtype: Q) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per lane of 4 weights: d [n, 64] and, for Q4_K / Q5_K, m [n, 64] (fp32)."""
    if qtype == Q.Q6_K:
        d = _f16(blocks, 208)[:, None] * blocks[:, 192:208].contiguous().view(torch.int8).float()
        return d.repeat_interleave(16 // LANE, dim=1), None
    scale, low = _scale_min_k4(blocks)
    d = _f16(blocks, 0)[:, None] * scale.float()
    m = -(_f16(blocks, 2)[:, None] * low.float())
    return d.repeat_interleave(32 // LANE, dim=1), m.repeat_interleave(32 // LANE, dim=1)
