"""Torch references of the per-layer operators (RMSNorm, in-place RoPE, SwiGLU's silu(gate) * up): the math
the models ran before the compiled kernels (csrc/layers.cpp), and the path wherever those are not built."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvforge.rope import rotate_half


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    var = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(var + eps))


def add_rms_norm_(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x (in place); returns RMSNorm of the sum."""
    residual.add_(x)
    return rms_norm(residual, weight, eps)


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """x [T, heads, dim] rotated in place; cos/sin [T, dim]."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    x.copy_(x * cos + rotate_half(x) * sin)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)
