"""Pack b-bit unsigned codes (b in 1, 2, 4, 8) along the last axis, 8 // b per byte."""
from __future__ import annotations

import torch


def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    return torch.arange(0, 8, bits, dtype=torch.int32, device=device)


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., d] integer codes in [0, 2**bits) -> [..., d * bits // 8] uint8."""
    per = 8 // bits
    q = q.to(torch.int32).view(*q.shape[:-1], q.shape[-1] // per, per)
    return (q << _shifts(bits, q.device)).sum(-1).to(torch.uint8)


def unpack(p: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of pack: [..., n] uint8 -> [..., n * 8 // bits] int32."""
    q = (p.to(torch.int32).unsqueeze(-1) >> _shifts(bits, p.device)) & ((1 << bits) - 1)
    return q.flatten(-2)
