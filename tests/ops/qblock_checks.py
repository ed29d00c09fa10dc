"""Checks both GGUF block families' kernel tests run (test_qblock_linear.py: 32-value blocks, test_kquant_linear.py:
K-quant super-blocks), on weights each test file makes its own way."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvforge.ops.int8 import quantize_blocks
from kvforge.ops.qblocks import dequantize, qblock_linear_reference


def reference_is_integer_dot(blocks: torch.Tensor, qtype, k: int, atol: float) -> None:
    """The reference equals x rounded per 32 values, as the kernel sees it, times the dequantized weight."""
    n = blocks.shape[0]
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(2))
    xq, dx = quantize_blocks(x)
    rounded = (xq.view(3, -1, 32) * dx[:, :, None]).view(3, -1)[:, :k]
    exact = rounded.double() @ dequantize(blocks, qtype).double().T
    got = qblock_linear_reference(x, blocks, int(qtype), n)
    assert torch.allclose(got.double(), exact, rtol=1e-5, atol=atol)
    full = x @ dequantize(blocks, qtype).T
    assert (got - full).norm() / full.norm() < 0.02  # 8-bit activations per 32 values


def compiled_few_rows(blocks: torch.Tensor, qtype, rows: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The compiled few-row kernel equals its reference bit for bit; (its output, x @ W.T + b on the dequantized W)."""
    n = blocks.shape[0]
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k))
    x[0, 32:64] = 0.0
    bias = torch.randn(n)
    got = torch.ops.kvforge.qblock_linear(x, blocks, int(qtype), n, bias)
    assert torch.equal(got, qblock_linear_reference(x, blocks, int(qtype), n, bias))
    return got, F.linear(x, dequantize(blocks, qtype), bias)
