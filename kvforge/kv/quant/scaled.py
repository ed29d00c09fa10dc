"""Symmetric per-token, per-head scaling into a narrow dtype (int8 or float8; float8 is read
through a byte table, see packing.py)."""
from __future__ import annotations

import torch

from kvforge.kv.layer_format import RawSide
from kvforge.kv.quant.codec import Codec, Layout
from kvforge.kv.quant.packing import byte_table, read_bytes

SCALE_DTYPE = torch.float16
MIN_SCALE = 1e-7


class ScaledCodec(Codec):
    """x ~= code * scale, with scale = max|x| / qmax over one head's row (stored as fp16)."""

    per_token = True

    def __init__(self, code_dtype: torch.dtype):
        self.code_dtype = code_dtype
        self.is_int = not code_dtype.is_floating_point
        self.qmax = 127.0 if self.is_int else float(torch.finfo(code_dtype).max)

    def layout(self, block_size: int, heads: int, dim: int) -> Layout:
        return [((block_size, heads, dim), self.code_dtype), ((block_size, heads), SCALE_DTYPE)]

    def encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        x = x.float()
        scale = (x.abs().amax(-1) / self.qmax).clamp_min(MIN_SCALE).to(SCALE_DTYPE)
        y = (x / scale.float().unsqueeze(-1)).clamp(-self.qmax, self.qmax)
        codes = y.round().to(self.code_dtype) if self.is_int else y.to(self.code_dtype)
        return [codes, scale]

    def _values(self, codes: torch.Tensor) -> torch.Tensor:
        if self.is_int:
            return codes.to(torch.float32)
        return read_bytes(byte_table(self.code_dtype, codes.device, lambda b: b.view(self.code_dtype)), codes)

    def decode(self, parts: list[torch.Tensor]) -> torch.Tensor:
        codes, scale = parts
        return self._values(codes).mul_(scale.unsqueeze(-1))

    def raw_side(self, parts: list[torch.Tensor]) -> RawSide:
        return RawSide("scaled", parts)
