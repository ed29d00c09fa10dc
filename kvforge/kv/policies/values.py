"""Value-row norms per full-attention layer and KV head, for policies that weigh attention by what a row carries."""
from __future__ import annotations

import torch

from kvforge.kv.policies.rows import layer_rows


def value_norms(kv, seq, start: int, end: int) -> torch.Tensor:
    """L1 norm of each value row of cache indices start..end-1, as [layers, kv_heads, end - start], layers in
    model order (the order attention statistics come in). MLA caches no values: its latent row's norm stands in."""
    rows = (v if v is not None else k for k, v in layer_rows(kv, seq, start, end))
    return torch.stack([r.float().abs().sum(-1).T.cpu() for r in rows])  # each [heads, end - start]
