"""Key rows per full-attention layer and KV head, for policies that score the cached keys themselves (keydiff)."""
from __future__ import annotations

import torch

from kvforge.kv.memory import blocks_for_tokens
from kvforge.kv.policies.compact import _slots, full_attention_layers


def key_rows(kv, seq, length: int) -> torch.Tensor:
    """Keys of cache indices 0..length-1 as the format decodes them (after RoPE), [layers, kv_heads, length, dim],
    layers in model order (the order attention statistics come in). MLA: its latent row is one head."""
    bs, index = kv.block_size, torch.arange(length)
    order = {layer: i for i, layer in enumerate(full_attention_layers(kv))}
    out: list[torch.Tensor | None] = [None] * len(order)
    device = kv.pool.slots[0].tensors()[0].device
    for g in kv.full_groups:
        table = torch.tensor(kv.block_table(seq, g)[: blocks_for_tokens(length, bs)], dtype=torch.long, device=device)
        slots = _slots(table, index, bs)
        for layer_kv, layer in zip(kv.pool.slots, kv.groups[g].layers):
            k, _ = layer_kv.read_rows(slots, bs)
            k = k if k.dim() == 3 else k[:, None]
            out[order[layer]] = k.float().transpose(0, 1).cpu()  # [heads, length, dim]
    return torch.stack(out)
