"""Weight-only int8 linear layers: per-output-channel symmetric int8 weights, fp32 activations and results.

`kvforge::int8_linear(x, qweight, scale, bias)` computes x @ (qweight * scale[:, None])^T + bias. The torch
reference dequantizes and calls F.linear (every device); the compiled CPU kernel (csrc/int8_matmul.cpp) widens
int8 to fp32 in registers for the few rows of a decode step, so a step reads a quarter of fp32's weight bytes.
Larger row counts (prefill chunks) dequantize once per call and run the BLAS, where the matmul dominates.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvforge.ops.build import disabled, load_compiled

LIB = torch.library.Library("kvforge", "FRAGMENT")
COMPILED_ROWS = 16  # up to this many rows the compiled kernel; more: dequantize + BLAS


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (int8 [N, K], fp32 scale [N]) with weight ~= q * scale[:, None], |q| <= 127."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127.0
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize(qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return qweight.float() * scale[:, None]


def int8_linear_reference(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, dequantize(qweight, scale), bias)


LIB.define("int8_linear(Tensor x, Tensor qweight, Tensor scale, Tensor? bias) -> Tensor")
LIB.impl("int8_linear", int8_linear_reference, "CompositeExplicitAutograd")


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] fp32 -> [..., N]: the compiled kernel for few rows of fp32 CPU input, else the reference."""
    rows = x.numel() // x.shape[-1]
    if (rows <= COMPILED_ROWS and x.device.type == "cpu" and x.dtype == torch.float32 and not disabled()
            and load_compiled()):
        out = torch.ops.kvforge.int8_linear(x.reshape(rows, x.shape[-1]), qweight, scale, bias)
        return out.view(*x.shape[:-1], qweight.shape[0])
    return int8_linear_reference(x, qweight, scale, bias)
