"""The fused layer bridge (csrc/layer_bridge.cpp): everything a decoder does between two attentions (Llama's layer
math, or a family's: Gemma's extra norms and GELU, Qwen3's head norms), for
the rows of a decode or verification step, in one operator call and one parallel region (the per-op path crosses
Python and forks the threads about ten times per layer). models/bridged.py runs a model's layers through it."""
from __future__ import annotations

import torch

from kvforge.ops.build import disabled, has_cpu_kernel

BRIDGE_ROWS = 8  # rows (query tokens of a step) up to which the bridge streams each weight once for all of them
WIDE_ROWS = 64  # rows up to which it takes fp32 weights as panels (batched decode, speculative verification)


def serves(x: torch.Tensor) -> bool:
    """True when the compiled bridge takes these hidden states [T, hidden]: fp32 on CPU, no gradient, at most
    WIDE_ROWS rows, the kernels built."""
    return (x.is_cpu and x.dtype == torch.float32 and x.dim() == 2 and x.shape[0] <= WIDE_ROWS
            and not (x.requires_grad and torch.is_grad_enabled()) and not disabled()
            and has_cpu_kernel("kvforge::layer_bridge"))


def layer_bridge(attn: torch.Tensor | None, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 post: list[torch.Tensor], pre: list[torch.Tensor], heads: int, kv_heads: int, eps: float,
                 kv_write: list[torch.Tensor], family_norms: list[torch.Tensor] | None = None,
                 activation: str = "silu") -> torch.Tensor:
    """See layers_reference.layer_bridge for the arguments."""
    return torch.ops.kvforge.layer_bridge(attn, residual, cos, sin, post, pre, heads, kv_heads, eps, kv_write,
                                          family_norms, activation)
