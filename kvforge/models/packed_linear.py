"""Linear layers through oneDNN with weights packed once, on CPU in fp32 inference.

On this project's CPUs (AMD EPYC, PyTorch's MKL build) `F.linear` with a few rows is far from the cost of one
row: 6 rows (a speculative verification step) took ~2.5x a decode step's matmul time and the 49k-row LM head
~2.3x, while oneDNN with pre-packed (blocked) weights runs 1 to 8 rows at about the cost of one and prefill
chunks 2-4x faster (figures and the command in docs/results.md). Results agree with `F.linear` to fp32
rounding (relative 1e-6), not bit for bit. Set KVFORGE_PACKED_LINEAR=0 to keep plain `F.linear`.
"""
from __future__ import annotations

import os

import torch
from torch import nn

ROWS_HINT = 8  # rows oneDNN picks the weight layout for (decode and verification steps)


class PackedLinear(nn.Linear):
    """An nn.Linear that keeps `weight` (state dicts, tied embeddings and direct readers see it unchanged) and
    a packed copy used whenever autograd is off and the input is fp32 on the CPU."""

    packed: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled() and x.dtype == torch.float32 and x.device.type == "cpu":
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return super().forward(x)


def packing_available() -> bool:
    return os.environ.get("KVFORGE_PACKED_LINEAR", "1") != "0" and torch.backends.mkldnn.is_available()


def pack_linears(model: nn.Module) -> int:
    """Turn the model's fp32 CPU nn.Linear layers into PackedLinear (idempotent); returns how many it packed."""
    if not packing_available():
        return 0
    packed = 0
    for module in model.modules():
        w = module.weight if type(module) is nn.Linear else None
        if w is None or w.device.type != "cpu" or w.dtype != torch.float32:
            continue
        with torch.no_grad():
            module.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), ROWS_HINT)
        module.__class__ = PackedLinear
        packed += 1
    return packed
