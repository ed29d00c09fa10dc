"""Compaction moves of quantized rows (KV policies), as a mixin of QuantLayerKV.

Rows keep what they read as: per-token codes and parameters move slot by slot; a destination block (or, for
per-head keep sets, one KV head of it) whose rows all come from one source block at the same offsets takes that
block's parts whole, per-channel key groups included; only rows regrouped into mixed blocks of a per-channel codec
are encoded again. Rows read from a staging entry have no codes yet and are encoded once where they land.
"""
from __future__ import annotations

import torch


class QuantMoves:
    """Needs QuantLayerKV's attributes (bs, sinks, codecs, parts, stage, sink, direct) and its write, read_rows,
    read_head_rows and _set_sink_rows."""

    def move(self, src: torch.Tensor, dst: torch.Tensor, block_size: int) -> None:
        """Rows keep their codes and parameters: per-token parts move slot by slot; a destination block
        filled from one source block at the same offsets takes that block's parts whole (per-channel too).
        Only per-channel parts of other destination blocks are encoded again (once); rows landing in a
        staged (fp16 window) block are held there as the fp16 of their decoded values."""
        src, dst = src.long(), dst.long()
        k, v = self.read_rows(src, block_size)
        if self.direct:
            for ps in self.parts:
                for p in ps:
                    flat = p.view(-1, *p.shape[2:])
                    flat[dst] = flat[src]
            self._set_sink_rows(dst, [k, v])
            return
        codes = [[p.view(-1, *p.shape[2:])[src] for p in ps] if c.per_token else [] for c, ps in zip(self.codecs, self.parts)]
        held = self._held_as_codes(src)  # before this move claims staging entries
        whole, dst_blocks, src_blocks, covered = self._whole_blocks(src, dst)
        if len(dst_blocks):
            if self.stage is not None:
                self.stage.release(dst_blocks)
            if self.sink is not None:
                self.sink.release(dst_blocks[~covered])
            for ps in self.parts:
                for p in ps:
                    p[dst_blocks] = p[src_blocks]
        rest = ~whole
        if bool(rest.any()):
            self.write(dst[rest], k[rest], v[rest] if v is not None else None)
            self._set_sink_rows(dst[rest], [k[rest], v[rest] if v is not None else None])
            kept = rest & held  # per-token codes as they were (staged rows hold fp16 copies)
            for ps, saved in zip(self.parts, codes):
                for p, rows in zip(ps, saved):
                    p.view(-1, *p.shape[2:])[dst[kept]] = rows[kept]

    def move_heads(self, src: torch.Tensor, dst: torch.Tensor, block_size: int) -> None:
        """Head h of row dst[i] takes head h of row src[i, h] with its per-token codes and parameters as stored;
        per-channel parts of the destination blocks are encoded again (once) from the decoded rows, and rows in
        staged (fp16 window) blocks are held there as the fp16 of their decoded values."""
        src, dst = src.long(), dst.long()
        k, v = self.read_head_rows(src, block_size)
        heads = torch.arange(src.shape[1], device=src.device)[None, :]
        codes = [[p.view(-1, *p.shape[2:])[src, heads] for p in ps] if c.per_token else []
                 for c, ps in zip(self.codecs, self.parts)]
        held = self._held_as_codes(src)
        whole = self._whole_heads(src, dst) if not self.direct else None
        if not self.direct:
            self.write(dst, k, v)
        self._set_sink_rows(dst, [k, v])
        at = (dst[:, None].expand_as(src)[held], heads.expand_as(src)[held])
        for ps, saved in zip(self.parts, codes):
            for p, rows in zip(ps, saved):
                p.view(-1, *p.shape[2:])[at] = rows[held]
        if whole is not None:
            self._put_whole_heads(*whole)

    def _whole_heads(self, src: torch.Tensor, dst: torch.Tensor) -> tuple | None:
        """(block, head) pairs of the destination blocks whose rows all come from one source block at the same
        offsets (rows that do not move count as coming from their own block), for codecs that store heads apart:
        those pairs' blocks, heads, and the source parts they take whole, per-channel groups included."""
        axes = [c.head_axes() if c is not None and not c.per_token else None for c in self.codecs]
        if all(a is None for a in axes):
            return None
        bs = self.bs
        blocks = torch.unique(dst // bs)
        full = (blocks[:, None] * bs + torch.arange(bs, device=dst.device))[..., None].repeat(1, 1, src.shape[1])
        full[torch.searchsorted(blocks, dst // bs), dst % bs] = src  # [blocks, bs, heads]: each row's source slot
        source = full[:, 0] // bs
        ok = ((full // bs == source[:, None]) & (full % bs == torch.arange(bs, device=dst.device)[:, None])).all(1)
        for table in (self.stage, self.sink):
            if table is not None:
                ok &= (table.lookup(source) < 0) & (table.lookup(blocks) < 0)[:, None]
        b, h = ok.nonzero(as_tuple=True)
        if not len(b):
            return None
        saved = [[p.movedim(1 + a, 1)[source[b, h], h] for p, a in zip(ps, ax)] if ax is not None else []
                 for ps, ax in zip(self.parts, axes)]
        return blocks[b], h, saved, axes

    def _put_whole_heads(self, blocks: torch.Tensor, heads: torch.Tensor, saved: list, axes: list) -> None:
        """After a move's write: the pairs of _whole_heads take their source parts, unless the write staged the block."""
        keep = self.stage.lookup(blocks) < 0 if self.stage is not None else torch.ones_like(blocks, dtype=torch.bool)
        for ps, parts, ax in zip(self.parts, saved, axes):
            for p, part, a in zip(ps, parts, ax or []):
                p.movedim(1 + a, 1)[blocks[keep], heads[keep]] = part[keep]

    def _held_as_codes(self, slots: torch.Tensor) -> torch.Tensor:
        """Whether each slot's row reads from its codes: not from a staging entry of its block (whose codes are
        not written until the block is flushed) nor from a sink entry (whose codes copy another row's)."""
        held = torch.ones_like(slots, dtype=torch.bool)
        blocks = slots // self.bs
        if self.stage is not None:
            held &= self.stage.lookup(blocks) < 0
        if self.sink is not None:
            held &= (self.sink.lookup(blocks) < 0) | (slots % self.bs >= self.sinks)
        return held

    def _whole_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Destination blocks whose rows all come from one source block at the same offsets, apart from rows
        their own sink entry covers and that stay: per row whether its block is one, those blocks, their
        source blocks, and whether each keeps its sink entry."""
        sb, db, offs = src // self.bs, dst // self.bs, dst % self.bs
        n = int(db.max()) + 1
        blank = torch.full((n,), -1, dtype=torch.long, device=db.device)
        count = torch.bincount(db, minlength=n)
        shifted = torch.bincount(db, weights=(src % self.bs != offs).float(), minlength=n) > 0
        first = blank.scatter_reduce(0, db, sb, "amin", include_self=False)
        last = blank.scatter_reduce(0, db, sb, "amax", include_self=False)
        low = blank.scatter_reduce(0, db, offs, "amin", include_self=False)
        source = first.clamp_min(0)
        keeps_sinks = torch.zeros(n, dtype=torch.bool, device=db.device)
        ok = ~shifted & (first == last) & (first >= 0)
        if self.stage is not None:
            ok &= self.stage.lookup(source) < 0
        if self.sink is not None:
            has = self.sink.lookup(torch.arange(n, device=db.device)) >= 0
            keeps_sinks = has & (low >= self.sinks)
            ok &= (self.sink.lookup(source) < 0) | keeps_sinks
        ok &= count == self.bs - keeps_sinks.long() * self.sinks
        blocks = ok.nonzero()[:, 0]
        return ok[db], blocks, first[blocks], keeps_sinks[blocks]
