"""FP8 KV cache: float8 codes with a per-token, per-head fp16 scale (max|x| maps to the dtype's max)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvforge.kv.quant.base import QuantFormat
from kvforge.kv.quant.codec import Codec
from kvforge.kv.quant.scaled import ScaledCodec
from kvforge.kv.spec import KVCacheSpec


class _FP8(QuantFormat):
    code_dtype: ClassVar[torch.dtype]

    def codecs(self, spec: KVCacheSpec) -> tuple[Codec, Codec | None]:
        return ScaledCodec(self.code_dtype), ScaledCodec(self.code_dtype) if spec.has_values else None


@dataclass
class FP8E4M3(_FP8):
    """OCP FP8 E4M3 (3 mantissa bits, max 448): the usual KV choice (vLLM `fp8_e4m3`)."""

    name = "fp8_e4m3"
    code_dtype = torch.float8_e4m3fn


@dataclass
class FP8E5M2(_FP8):
    """FP8 E5M2 (2 mantissa bits, wide range): coarser than E4M3 on KV values."""

    name = "fp8_e5m2"
    code_dtype = torch.float8_e5m2
