"""Weight-only int8 linear layers: per-output-channel symmetric int8 weights, fp32 results.

`kvforge::int8_linear(x, qweight, scale, bias)`, for the few rows of a decode step: each row of x is rounded to
int16 with its own scale (error <= max|x| / 65534 per element), the products are exact integer dot products
(AVX-512 VNNI in the compiled kernel, csrc/int8_matmul.cpp; the torch reference below computes the same
integers), then both scales apply: a step reads a quarter of fp32's weight bytes. Larger row counts (prefill
chunks) dequantize once per call and run the BLAS on fp32 activations, where the matmul dominates.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvforge.ops.build import disabled, load_compiled

LIB = torch.library.Library("kvforge", "FRAGMENT")
COMPILED_ROWS = 16  # up to this many rows the operator; more: dequantize + BLAS
INT16_MAX = 32767.0


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (int8 [N, K], fp32 scale [N]) with weight ~= q * scale[:, None], |q| <= 127."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127.0
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize(qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return qweight.float() * scale[:, None]


def quantize_rows_int16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (integers |xq| <= 32767 as fp32 [M, K], scale [M]) with x ~= xq * scale[:, None]."""
    amax = x.abs().amax(dim=1)
    limit, zero = torch.full_like(amax, INT16_MAX), torch.zeros_like(amax)  # tensor / tensor: IEEE division, as
    inv = torch.where(amax > 0, limit / amax, zero)  # the kernel (a scalar operand may become a reciprocal)
    return torch.round(x * inv[:, None]), torch.where(amax > 0, amax / limit, zero)


def int8_linear_reference(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """The operator's definition: int16 rows of x times int8 weights, summed exactly (float64), then scaled."""
    xq, x_scale = quantize_rows_int16(x)
    dots = (xq.double() @ qweight.double().T).float()
    out = dots * (x_scale[:, None] * scale[None, :])
    return out if bias is None else out + bias


def dequantized_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """Many rows: fp32 activations against the dequantized weight (the BLAS)."""
    return F.linear(x, dequantize(qweight, scale), bias)


LIB.define("int8_linear(Tensor x, Tensor qweight, Tensor scale, Tensor? bias) -> Tensor")
LIB.impl("int8_linear", int8_linear_reference, "CompositeExplicitAutograd")


def compiled_for(x: torch.Tensor) -> bool:
    """Whether the compiled int8_linear serves input x (fp32 on the CPU, kernels built)."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and not disabled() and load_compiled()


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] fp32 -> [..., N]: the compiled operator for few rows of fp32 CPU input, else dequantize + BLAS."""
    rows = x.numel() // x.shape[-1]
    if rows <= COMPILED_ROWS and compiled_for(x):
        out = torch.ops.kvforge.int8_linear(x.reshape(rows, x.shape[-1]), qweight, scale, bias)
        return out.view(*x.shape[:-1], qweight.shape[0])
    return dequantized_linear(x, qweight, scale, bias)
