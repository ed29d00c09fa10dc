"""Value-row norms per full-attention layer and KV head, for policies that weigh attention by what a row carries."""
from __future__ import annotations

import torch

from kvforge.kv.memory import blocks_for_tokens
from kvforge.kv.policies.compact import _slots, full_attention_layers


def value_norms(kv, seq, start: int, end: int) -> torch.Tensor:
    """L1 norm of each value row of cache indices start..end-1, as [layers, kv_heads, end - start], layers in
    model order (the order attention statistics come in). MLA caches no values: its latent row's norm stands in."""
    bs, index = kv.block_size, torch.arange(start, end)
    order = {layer: i for i, layer in enumerate(full_attention_layers(kv))}
    out: list[torch.Tensor | None] = [None] * len(order)
    device = kv.pool.slots[0].tensors()[0].device
    for g in kv.full_groups:
        table = torch.tensor(kv.block_table(seq, g)[: blocks_for_tokens(end, bs)], dtype=torch.long, device=device)
        slots = _slots(table, index, bs)
        for layer_kv, layer in zip(kv.pool.slots, kv.groups[g].layers):
            k, v = layer_kv.read_rows(slots, bs)
            rows = v if v is not None else k
            out[order[layer]] = rows.float().abs().sum(-1).T.cpu()  # [heads, end - start]
    return torch.stack(out)
