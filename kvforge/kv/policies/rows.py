"""Cached rows of one sequence per full-attention layer, as the format decodes them, for policies that score them."""
from __future__ import annotations

import torch

from kvforge.kv.memory import blocks_for_tokens
from kvforge.kv.policies.compact import _slots, full_attention_layers


def layer_rows(kv, seq, start: int, end: int) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(K, V) of cache indices start..end-1 for each full-attention layer, in model order (the order attention
    statistics come in); V is None where the layer caches none (MLA's latent row)."""
    bs, index = kv.block_size, torch.arange(start, end)
    order = {layer: i for i, layer in enumerate(full_attention_layers(kv))}
    out: list = [None] * len(order)
    device = kv.pool.slots[0].tensors()[0].device
    for g in kv.full_groups:
        table = torch.tensor(kv.block_table(seq, g)[: blocks_for_tokens(end, bs)], dtype=torch.long, device=device)
        slots = _slots(table, index, bs)
        for layer_kv, layer in zip(kv.pool.slots, kv.groups[g].layers):
            out[order[layer]] = layer_kv.read_rows(slots, bs)
    return out
