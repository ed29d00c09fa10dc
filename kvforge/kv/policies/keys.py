"""Key rows per full-attention layer and KV head, for policies that score the cached keys themselves (keydiff)."""
from __future__ import annotations

import torch

from kvforge.kv.policies.rows import layer_rows


def key_rows(kv, seq, length: int) -> torch.Tensor:
    """Keys of cache indices 0..length-1 as the format decodes them (after RoPE), [layers, kv_heads, length, dim],
    layers in model order (the order attention statistics come in). MLA: its latent row is one head."""
    keys = (k if k.dim() == 3 else k[:, None] for k, _ in layer_rows(kv, seq, 0, length))
    return torch.stack([k.float().transpose(0, 1).cpu() for k in keys])  # each [heads, length, dim]
