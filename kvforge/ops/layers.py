"""Per-layer operators as the models call them: the compiled kernel (csrc/layers.cpp) for fp32 CPU tensors
that need no gradient, else the torch reference (ops/layers_reference.py), called directly."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvforge.ops import layers_reference
from kvforge.ops.build import disabled, has_cpu_kernel, load_compiled
from kvforge.ops.panels import panels


def _compiled(x: torch.Tensor) -> bool:
    return (x.is_cpu and x.dtype == torch.float32 and not (x.requires_grad and torch.is_grad_enabled())
            and not disabled() and load_compiled())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _compiled(x):
        return torch.ops.kvforge.rms_norm(x, weight, eps)
    return layers_reference.rms_norm(x, weight, eps)


def add_rms_norm_(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x in place, then rms_norm of it: a decoder's residual add and the following norm."""
    if _compiled(residual) and residual.is_contiguous():
        return torch.ops.kvforge.add_rms_norm_(residual, x, weight, eps)
    return layers_reference.add_rms_norm_(residual, x, weight, eps)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, dim] rotated (in place when compiled: x is a projection's fresh output); cos/sin [T, dim]."""
    if _compiled(x):
        torch.ops.kvforge.rope_(x, cos, sin)
        return x
    from kvforge.rope import apply_rope

    return apply_rope(x, cos, sin)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a fused [.., 2 * inter] gate/up projection."""
    if _compiled(gate_up):
        return torch.ops.kvforge.silu_mul(gate_up)
    return layers_reference.silu_mul(gate_up)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up of a fused [.., 2 * inter] gate/up projection (Gemma's MLP)."""
    if _compiled(gate_up):
        return torch.ops.kvforge.gelu_tanh_mul(gate_up)
    return layers_reference.gelu_tanh_mul(gate_up)


SMALL_ROWS = 4  # without oneDNN, up to this many rows the compiled small_linear beats the BLAS
SMALL_ROWS_WIDE = 32  # and up to this many for wide outputs (the vocabulary projection)
WIDE = 8192
STREAM_ROWS = 6  # up to this many rows small_linear streams the weights once (one decode row plus 5 drafts),
STREAM_FLOATS = 8192  # while those rows of x (rows * K floats) stay in the L1 cache; panels or oneDNN above


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for fp32 CPU inference: a few rows (a decode step of a few sequences, a speculative
    verification) through the compiled small_linear, which reads each weight once; more rows (batched decode,
    verification, prefill) through panel_linear on the weight's panel copy (models/weight_store.py makes it when an
    engine is built), as fast as oneDNN on a packed copy at prefill sizes and faster below
    (`python -m kvforge.bench.matmul` measures them)."""
    if not _compiled(x) or x.dim() != 2 or (weight.requires_grad and torch.is_grad_enabled()):
        return F.linear(x, weight, bias)
    rows = x.shape[0]
    if rows > 1 and (rows > STREAM_ROWS or rows * x.shape[1] > STREAM_FLOATS):
        weight_panels = panels(weight)
        if weight_panels is not None:
            return torch.ops.kvforge.panel_linear(x, weight_panels, weight.shape[0], bias)
    if rows <= max(STREAM_ROWS, SMALL_ROWS_WIDE if weight.shape[0] >= WIDE else SMALL_ROWS):
        return torch.ops.kvforge.small_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def int8_panel_linear(x: torch.Tensor, panels: torch.Tensor, scale: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ (int8 panels [P, K, 16] dequantized with one scale per column)^T: the compiled kernel (the same
    floats as panel_linear on the dequantized panels), or off the compiled path F.linear on the dequantized weight."""
    if _compiled(x) and has_cpu_kernel("kvforge::int8_panel_linear"):
        return torch.ops.kvforge.int8_panel_linear(x, panels, scale, scale.numel(), bias)
    return layers_reference.int8_panel_linear(x, panels, scale, scale.numel(), bias)
