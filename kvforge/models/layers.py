"""Building blocks shared by the model families: RMSNorm, rotary embeddings, gated MLP."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.errors import ModelLoadError
from kvforge.models.int8_weights import linear
from kvforge.models.quant_weights import fuse_blocks
from kvforge.ops.layers import rms_norm, silu_mul


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    @property
    def multiplier(self) -> torch.Tensor:
        """The weight the normalized values are multiplied by (a family may store it otherwise: gemma.py)."""
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class GatedMLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)); after `fuse_projections`, gate and up are one matmul."""

    activation = "silu"  # the layer bridge's name for it (ops/layers_reference.GATED)

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.register_buffer("gate_up_weight", None, persistent=False)

    def fuse_projections(self) -> None:
        self.gate_up_weight = fuse_linears(self.gate_proj, self.up_proj)[0]

    def linear_weights(self) -> list[torch.Tensor]:
        """The weights forward multiplies through ops `linear` (models/weight_store.py gives them their layouts)."""
        return [] if self.gate_up_weight is None else [self.gate_up_weight, self.down_proj.weight]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is not None:
            return linear(silu_mul(linear(x, self.gate_up_weight)), self.down_proj.weight)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


@torch.no_grad()
def unfilled_embedding(num: int, dim: int) -> nn.Embedding:
    """An embedding whose weight is left unfilled (loading assigns it): on the meta device nn.Embedding's normal_
    init alone imports torch._dynamo, over a second of start-up."""
    return nn.Embedding(num, dim, _weight=torch.empty(num, dim))


def fuse_linears(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) holding the given projections' rows in order; each projection's parameters become
    views into it, so one matmul computes them all and no weight is stored twice."""
    blocks = fuse_blocks(linears)  # weights held as GGUF blocks (models/quant_weights.py) fuse their blocks
    weight = torch.cat([lin.weight for lin in linears]) if blocks is None else blocks
    biases = [lin.bias for lin in linears]
    bias = torch.cat(biases) if all(b is not None for b in biases) else None
    first = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        if blocks is None:
            lin.weight = nn.Parameter(weight[first: first + rows], requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias[first: first + rows], requires_grad=False)
        first += rows
    return weight, bias


def rope_inv_freq(dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))  # cpu: tiny, and meta-built models would import torch._dynamo for it
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        out = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        medium = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        return torch.where(medium, smoothed, out)
    raise ModelLoadError(f"rope_scaling type {kind!r} is not supported; supported: default, linear, llama3")


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in the rotate-half convention (Hugging Face Llama)."""

    def __init__(self, dim: int, theta: float, scaling: dict | None = None):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(dim, theta, scaling), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()
