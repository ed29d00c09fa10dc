"""oneDNN's linear with the weight packed once (blocked layout): no longer on the engine's path (panel_linear is as fast
at prefill sizes on the weight's one panel copy, models/weight_store.py); kept for bench/matmul.py's comparison.

On this project's CPU (AMD EPYC, PyTorch's MKL build) `F.linear` with a few rows costs far more than one row,
while oneDNN with a pre-packed weight runs 2 to 32 rows at about 1.1-3x the cost of one and prefill-sized
inputs ~2.2x faster than MKL (`python -m kvforge.bench.matmul`). The packed copy is made on a
weight's first multi-row use and kept as an attribute of that weight tensor, so it lives and dies with it.
Results agree with `F.linear` to fp32 rounding (relative 1e-6), not bit for bit. KVFORGE_PACKED_LINEAR=0 opts out.
"""
from __future__ import annotations

import functools
import os

import torch

ROWS_HINT = 8  # rows oneDNN picks the layout for; measured fast from 2 to 1,024 rows
ATTRIBUTE = "_kvforge_onednn_packed"


@functools.cache
def packing_available() -> bool:
    return os.environ.get("KVFORGE_PACKED_LINEAR", "1") != "0" and torch.backends.mkldnn.is_available()


def packed(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight's oneDNN-packed copy (made now if new), or None where packing does not apply."""
    cached = getattr(weight, ATTRIBUTE, None)
    if cached is not None or not packing_available():
        return cached
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    with torch.no_grad():
        cached = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), ROWS_HINT)
    setattr(weight, ATTRIBUTE, cached)
    return cached


def packed_linear(x: torch.Tensor, weight_packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight_packed, bias, "none", [], "")
