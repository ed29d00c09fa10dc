"""Pack b-bit unsigned codes (b in 1, 2, 4, 8) along the last axis, 8 // b per byte, and read bytes
through 256-row tables (byte -> fp32 values): one gather instead of shift, mask and convert,
about twice as fast for 2-bit codes on CPU and 5x for float8_e4m3fn.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

_TABLES: dict[tuple[object, torch.device], torch.Tensor] = {}


def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    return torch.arange(0, 8, bits, dtype=torch.int32, device=device)


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., d] integer codes in [0, 2**bits) -> [..., d * bits // 8] uint8."""
    per = 8 // bits
    q = q.to(torch.int32).view(*q.shape[:-1], q.shape[-1] // per, per)
    return (q << _shifts(bits, q.device)).sum(-1).to(torch.uint8)


def byte_table(key: object, device: torch.device, build: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The table build(all 256 bytes as uint8) for `key`, built once per device."""
    if (key, device) not in _TABLES:
        _TABLES[key, device] = build(torch.arange(256, dtype=torch.uint8, device=device)).float()
    return _TABLES[key, device]


def read_bytes(table: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """table[p] for uint8-sized codes p of any byte dtype: [..., n] -> [..., n * values per byte]."""
    values = table.index_select(0, p.view(torch.uint8).reshape(-1).int())
    return values.view(*p.shape[:-1], -1)


def unpack(p: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of pack: [..., n] uint8 -> [..., n * 8 // bits] float32 codes."""
    table = byte_table(("unpack", bits), p.device,
                       lambda b: (b.int().unsqueeze(-1) >> _shifts(bits, b.device)) & ((1 << bits) - 1))
    return read_bytes(table, p)
