"""INT8 KV cache: symmetric per-token, per-head absmax quantization (scale = max|x| / 127, fp16).

Rows are independent, so writes go straight into the codes (no staging, no side buffers).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvforge.kv.quant.base import ScaledFormat


@dataclass
class INT8(ScaledFormat):
    name = "int8"
    code_dtype = torch.int8
