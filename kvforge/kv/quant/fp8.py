"""FP8 KV cache: float8 codes with a per-token, per-head fp16 scale (max|x| maps to the dtype's max).

fp8_e4m3 keeps the most recent tokens of each sequence in fp16 (`window` 16, rounded up to whole blocks:
the block being filled and the one before; a per-sequence side cost, 2k-token sequences per GiB 1.91x
fp16): chosen on the evaluation panel (docs/results.md), where plain e4m3 lost up to 1.25% on a license
text; with the window no panel text loses more than 0.4%. `{"window": 0}` gives the plain format.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvforge.kv.quant.base import ScaledFormat


@dataclass
class FP8E4M3(ScaledFormat):
    """OCP FP8 E4M3 (3 mantissa bits, max 448): the usual KV choice (vLLM `fp8_e4m3`)."""

    name = "fp8_e4m3"
    code_dtype = torch.float8_e4m3fn
    window: int = 16


@dataclass
class FP8E5M2(ScaledFormat):
    """FP8 E5M2 (2 mantissa bits, wide range): coarser than E4M3 on KV values."""

    name = "fp8_e5m2"
    code_dtype = torch.float8_e5m2
