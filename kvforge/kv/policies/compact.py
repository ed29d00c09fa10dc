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


def _slots(table: torch.Tensor, idx: torch.Tensor, bs: int) -> torch.Tensor:
    """Flat slot ids of cache indices idx under a block table."""
    idx = idx.to(table.device)
    return table[idx // bs] * bs + idx % bs


def compact(kv, seq, keep: torch.Tensor, rotary=None, whole_blocks: bool = False) -> int:
    """Keep cache indices `keep` (sorted) of seq, in order, at indices 0..len(keep)-1; returns tokens dropped.

    Rows move through the format's own `move`, which keeps their stored codes and parameters where it can
    (see QuantLayerKV.move), so a quantized row is not rounded a second time. Rows that do not move are not
    touched. With `rotary` (policies whose attention sees cache-index distances) new tokens are rotated at
    their logical position, which is their cache index plus the tokens dropped so far; a kept key then needs
    turning only when its index changes by other than the tokens dropped now: for StreamingLLM only its sinks
    (by +dropped), while the recent rows move as they are. Blocks past the kept rows go back to the allocator.
    whole_blocks (keep not sorted, placement.in_place): a block whose first row moves is written whole, the rows that
    stay included (a format starts a block written at offset 0 anew), and so is the block the new tokens will fill,
    so a staged format gives it an fp16 window entry and does not encode it again at every later write.
    """
    length, bs = kv.cache_len(seq), kv.block_size
    m = int(keep.shape[-1])
    if m >= length:
        return 0
    if keep.dim() > 1:
        return _compact_layers(kv, seq, keep.long().cpu(), length, whole_blocks)
    keep = keep.long().cpu()
    index = torch.arange(m)
    moved = rows_to_write(keep != index, bs) if whole_blocks else keep != index
    shift = index - keep + (length - m)
    turned = shift != 0 if rotary is not None else torch.zeros(m, dtype=torch.bool)
    if bool(moved.any()) or bool(turned.any()):
        kv.stage_for_compaction(seq, m)
        device = kv.pool.slots[0].tensors()[0].device
        for group in kv.full_groups:  # sliding-window groups bound themselves
            table = torch.tensor(kv.block_table(seq, group)[: blocks_for_tokens(length, bs)], dtype=torch.long,
                                 device=device)

            for layer in kv.pool.slots:
                if bool(moved.any()):
                    layer.move(_slots(table, keep[moved], bs), _slots(table, index[moved], bs), bs)
                if bool(turned.any()):
                    at = _slots(table, index[turned], bs)
                    k, v = layer.read_rows(at, bs)
                    layer.rewrite(at, rerotate(k, shift[turned], rotary), v)
    kv.truncate(seq, m)
    kv.record_evicted(seq, length - m)
    return length - m


def full_attention_layers(kv) -> list[int]:
    """Model layers of the full-attention KV groups, in model order (the order attention statistics come in)."""
    return sorted(layer for g in kv.full_groups for layer in kv.groups[g].layers)


def rows_to_write(moved: torch.Tensor, bs: int) -> torch.Tensor:
    """Every row of a block whose first row moves (a format takes a block written at offset 0 for a new one and
    starts it from zeros), and where any row moves, of the block the new tokens will fill (past the last whole block,
    not the first: that one holds the sinks)."""
    m = len(moved)
    firsts = moved[::bs].repeat_interleave(bs)[:m]
    start = m // bs * bs
    if start and start < m and bool(moved.any()):
        firsts[start:] = True
    return moved | firsts


def _compact_layers(kv, seq, keep: torch.Tensor, length: int, whole_blocks: bool = False) -> int:
    """keep: [layers, heads or 1, m], a kept set per full-attention layer (and KV head); each layer's rows move
    (through LayerKV.move, or move_heads when its heads keep different rows) to indices 0..m-1."""
    m, bs = keep.shape[-1], kv.block_size
    index = torch.arange(m)
    order = {layer: i for i, layer in enumerate(full_attention_layers(kv))}
    device = kv.pool.slots[0].tensors()[0].device
    kv.stage_for_compaction(seq, m)
    for g in kv.full_groups:
        table = torch.tensor(kv.block_table(seq, g)[: blocks_for_tokens(length, bs)], dtype=torch.long, device=device)
        for layer_kv, layer in zip(kv.pool.slots, kv.groups[g].layers):
            rows = keep[order[layer]]  # [heads or 1, m]
            moved = (rows != index).any(0)
            if whole_blocks:
                moved = rows_to_write(moved, bs)
            if not bool(moved.any()):
                continue
            dst = _slots(table, index[moved], bs)
            if bool((rows == rows[:1]).all()):
                layer_kv.move(_slots(table, rows[0, moved], bs), dst, bs)
            else:
                layer_kv.move_heads(_slots(table, rows[:, moved].T, bs), dst, bs)
    kv.truncate(seq, m)
    kv.record_evicted(seq, length - m)
    return length - m
