"""Per-layer operators as the models call them: the compiled kernel (csrc/layers.cpp) for fp32 CPU tensors
that need no gradient, else the torch reference (ops/layers_reference.py), called directly. Linear layers run
through oneDNN with weights packed once (see `linear`)."""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from kvforge.ops import layers_reference
from kvforge.ops.build import disabled, load_compiled


def _compiled(x: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype == torch.float32 and not (x.requires_grad and torch.is_grad_enabled())
            and not disabled() and load_compiled())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _compiled(x):
        return torch.ops.kvforge.rms_norm(x, weight, eps)
    return layers_reference.rms_norm(x, weight, eps)


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


SMALL_ROWS = 4  # without packing: up to this many rows the compiled small_linear beats the BLAS (MKL)
SMALL_ROWS_WIDE = 32  # and up to this many for wide outputs (the vocabulary projection)
WIDE = 8192
ROWS_HINT = 8  # rows oneDNN picks the packed weight layout for (decode and verification steps)


def packing_available() -> bool:
    """oneDNN with packed weights for fp32 CPU linears; KVFORGE_PACKED_LINEAR=0 keeps small_linear / F.linear."""
    return os.environ.get("KVFORGE_PACKED_LINEAR", "1") != "0" and torch.backends.mkldnn.is_available()


def packed_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked copy of a fp32 CPU weight, made on first use and kept on the weight tensor itself (so it
    lives and dies with it); None when packing is off or does not apply."""
    packed = getattr(weight, "_kvforge_packed", None)
    if packed is None and weight.device.type == "cpu" and weight.dtype == torch.float32 and packing_available():
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ROWS_HINT)
        weight._kvforge_packed = packed
    return packed


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for inference: oneDNN with the weight packed once (on this CPU 1.3-1.6x faster than small_linear
    or MKL at one row, ~2.5x at 2-256 rows: `python -m kvforge.ops.bench_matmul`); without packing, the compiled
    small_linear for the few rows of a decode step, else the BLAS."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and not torch.is_grad_enabled():
        packed = packed_weight(weight)
        if packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    rows = x.shape[0] if x.dim() == 2 else SMALL_ROWS_WIDE + 1
    if rows <= (SMALL_ROWS_WIDE if weight.shape[0] >= WIDE else SMALL_ROWS) and _compiled(x):
        return torch.ops.kvforge.small_linear(x, weight, bias)
    return F.linear(x, weight, bias)
