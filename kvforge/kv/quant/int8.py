"""INT8 KV cache: symmetric per-token, per-head absmax quantization (scale = max|x| / 127, fp16)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvforge.kv.quant.base import QuantFormat
from kvforge.kv.quant.codec import Codec
from kvforge.kv.quant.scaled import ScaledCodec
from kvforge.kv.spec import KVCacheSpec


@dataclass
class INT8(QuantFormat):
    """Rows are independent, so writes go straight into the codes (no staging, no side buffers)."""

    name = "int8"

    def codecs(self, spec: KVCacheSpec) -> tuple[Codec, Codec | None]:
        return ScaledCodec(torch.int8), ScaledCodec(torch.int8) if spec.has_values else None
