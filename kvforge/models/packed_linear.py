"""Linear layers through oneDNN with weights packed once, on CPU in fp32 inference.

On this project's CPUs (AMD EPYC, PyTorch's MKL build) `F.linear` with a few rows is far from the cost of one
row: 6 rows (a speculative verification step) took ~2.5x a decode step's matmul time and the 49k-row LM head
~2.3x, while oneDNN with pre-packed (blocked) weights runs 1 to 8 rows at about the cost of one and prefill
chunks 2-4x faster (figures and the command in docs/results.md). Results agree with `F.linear` to fp32
rounding (relative 1e-6), not bit for bit. Set KVFORGE_PACKED_LINEAR=0 to keep plain `F.linear`.
"""
from __future__ import annotations

import torch
from torch import nn

from kvforge.ops.layers import linear, packed_weight


class PackedLinear(nn.Linear):
    """An nn.Linear whose forward runs `ops.layers.linear`: oneDNN with a packed copy of `weight`, kept on the
    weight tensor (state dicts, tied embeddings and direct readers see `weight` unchanged)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def pack_linears(model: nn.Module) -> int:
    """Turn the model's fp32 CPU nn.Linear layers into PackedLinear (idempotent); returns how many it packed."""
    packed = 0
    for module in model.modules():
        w = module.weight if type(module) is nn.Linear else None
        if w is None or w.device.type != "cpu" or w.dtype != torch.float32:
            continue
        if packed_weight(w) is None:
            return 0
        module.__class__ = PackedLinear
        packed += 1
    return packed
