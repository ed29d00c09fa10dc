"""Vectorized torch dequantization of ggml block types: Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K.

Each function takes the raw blocks as a [n_blocks, block_bytes] uint8 tensor and returns [n_blocks, values]
float32, computed in the same order as ggml's reference, so results are bit-identical to it.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from gguf import GGMLQuantizationType as Q


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 scalar at byte `start` of every block, as [n_blocks, 1] float32."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n]: all low nibbles, then all high nibbles."""
    return torch.cat((qs & 0xF, qs >> 4), dim=-1)


def q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return blocks[:, 2:].view(torch.int8).float().mul_(_f16(blocks, 0))


def q4_0(blocks: torch.Tensor) -> torch.Tensor:
    return _f16(blocks, 0) * (_nibbles(blocks[:, 2:]).to(torch.int8) - 8).float()


def q4_1(blocks: torch.Tensor) -> torch.Tensor:
    return _f16(blocks, 0) * _nibbles(blocks[:, 4:]).float() + _f16(blocks, 2)


def q5_0(blocks: torch.Tensor) -> torch.Tensor:
    bits = (blocks[:, 2:6, None] >> torch.arange(8, dtype=torch.uint8)) & 1  # the 32 fifth bits, little-endian
    q = _nibbles(blocks[:, 6:]) | (bits.reshape(-1, 32) << 4)
    return _f16(blocks, 0) * (q.to(torch.int8) - 16).float()


def q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    s = blocks[:, 4:16].to(torch.int32)  # 8 six-bit scales and 8 six-bit mins, packed in 12 bytes
    scale = torch.cat((s[:, 0:4] & 63, (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)), dim=1)
    low = torch.cat((s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)), dim=1)
    d = (_f16(blocks, 0) * scale.float())[:, :, None]
    dmin = (_f16(blocks, 2) * low.float())[:, :, None]
    qs = blocks[:, 16:].reshape(n, 4, 32)
    q = torch.stack((qs & 0xF, qs >> 4), dim=2).reshape(n, 8, 32).float()
    return (d * q - dmin).reshape(n, 256)


def q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    ql = blocks[:, :128].reshape(n, 2, 64)
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]
    low = torch.stack((ql[..., :32] & 0xF, ql[..., 32:] & 0xF, ql[..., :32] >> 4, ql[..., 32:] >> 4), dim=2)
    q = ((low | ((qh & 3) << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    d = _f16(blocks, 208) * blocks[:, 192:208].contiguous().view(torch.int8).float()
    return (d[:, :, None] * q).reshape(n, 256)


DEQUANTIZE: dict[Q, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.Q4_0: q4_0, Q.Q4_1: q4_1, Q.Q5_0: q5_0, Q.Q8_0: q8_0, Q.Q4_K: q4_k, Q.Q6_K: q6_k,
}


def dequantize_torch(raw: torch.Tensor, qtype: Q, block_bytes: int) -> torch.Tensor | None:
    """Flat float32 values of raw uint8 GGUF data; None for block types this module does not handle."""
    fn = DEQUANTIZE.get(qtype)
    return fn(raw.reshape(-1, block_bytes)).reshape(-1) if fn else None
