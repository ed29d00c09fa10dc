"""Compaction: move a sequence's kept cache rows to the front of its block table and free the rest."""
from __future__ import annotations

import torch

from kvforge.kv.memory import blocks_for_tokens
from kvforge.rope import apply_rope


def rerotate(k: torch.Tensor, shift: torch.Tensor, rotary) -> torch.Tensor:
    """Keys rotated at position p become keys rotated at p + shift (RoPE rotations compose)."""
    if hasattr(rotary, "rerotate"):  # MLA: only the rotary part of the latent row turns
        return rotary.rerotate(k, shift)
    cos, sin = rotary.cos_sin(shift.to(k.device))
    return apply_rope(k, cos.to(k.dtype), sin.to(k.dtype))


def compact(kv, seq, keep: torch.Tensor, rotary=None) -> int:
    """Keep cache indices `keep` (sorted) of seq, in order, at indices 0..len(keep)-1; returns tokens dropped.

    Rows through the format's own gather/write (decode, re-encode), so every KV format works. Rows that
    do not move are not touched. With `rotary`, moved keys are re-rotated to their new index.
    Blocks past the kept rows go back to the allocator, so the bytes in use really drop.
    """
    length, bs = kv.cache_len(seq), kv.block_size
    m = int(keep.shape[0])
    if m >= length:
        return 0
    keep = keep.long().cpu()
    moved = (keep != torch.arange(m)).nonzero()
    if len(moved):
        first = int(moved[0])
        device = kv.pool.slots[0].tensors()[0].device
        g0 = int(keep[first]) // bs
        src = (keep[first:] - g0 * bs).to(device)
        dst_pos = torch.arange(first, m)
        shift = dst_pos - keep[first:]
        for group in kv.full_groups:  # sliding-window groups bound themselves
            table = torch.tensor(kv.block_table(seq, group)[: blocks_for_tokens(length, bs)], dtype=torch.long,
                                 device=device)
            dst = (table[(dst_pos // bs).to(device)] * bs + (dst_pos % bs).to(device))
            for layer in kv.pool.slots:
                k, v = layer.gather(table[g0:])
                k, v = k[src], (v[src] if v is not None else None)
                if rotary is not None:
                    k = rerotate(k, shift, rotary)
                layer.write(dst, k, v)
    kv.truncate(seq, m)
    kv.record_evicted(seq, length - m)
    return length - m
