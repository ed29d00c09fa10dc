"""QuantLayerKV: one layer's quantized blocks, an fp16 staging area for recent blocks, and exact sinks.

Staging (used when a codec needs a whole block, e.g. per-channel keys, or a residual window is on):
a block written at offset 0 is new; when `may_stage` (set by the pool, kept by the KV manager: the blocks of
each request's own window) lets it, it claims a staging entry and its rows stay fp16 there. A staged block that
leaves every window is flushed: encoded from its fp16 rows (`unstage`, or at the end of the write that filled it);
freed blocks drop their entries (`forget_blocks`). So a block's numerics follow its own request only. A claim
takes a free entry, else one of a block outside every window (flushing it); only without a pool's manager, or if
windows outnumbered entries, the oldest full block's, then the oldest partial one's. Rows of a block without an
entry are merged by decode -> insert rows -> encode.
Sinks: rows with position < sinks are also copied into an fp16 sink entry of their block (claimed
when position 0 is written); they override the decoded rows and are left out of the block's
quantization ranges. A claim takes free entries, then the oldest of blocks that no running request starts
with (`sink_pins`), e.g. cached first blocks. A block written at offset 0 drops its old entries.
"""
from __future__ import annotations

import torch

from kvforge.kv.layer_format import LayerKV, RawKV
from kvforge.kv.lazy_zeros import lazy_zeros
from kvforge.kv.quant.block_io import QuantBlockIO
from kvforge.kv.quant.codec import Codec
from kvforge.kv.quant.moves import QuantMoves
from kvforge.kv.quant.overlay import overlay_exact
from kvforge.kv.quant.sidetable import Claim, SideTable
from kvforge.kv.quant.staging_op import stage_append
from kvforge.kv.spec import KVCacheSpec

EXACT_DTYPE = torch.float16
PARTIAL_BIAS = 1 << 48
WINDOW_BIAS = 1 << 56  # entries of blocks in some window go last (above any age)
FAST_ROWS = 64  # writes of up to this many rows try the staged fast path (decode, speculation)


class QuantLayerKV(QuantMoves, QuantBlockIO, LayerKV):
    def __init__(self, spec: KVCacheSpec, num_blocks: int, block_size: int, codecs: tuple[Codec, Codec | None],
                 stage_entries: int, sinks: int, sink_entries: int, device: torch.device):
        self.bs, self.sinks = block_size, sinks
        self.codecs = codecs
        dims = (spec.head_dim, spec.v_head_dim)
        self.shapes = [(spec.num_kv_heads, d) for d in dims if d > 0]
        self.parts = [[lazy_zeros(num_blocks, *shape, dtype=dtype, device=device)
                       for shape, dtype in c.layout(block_size, *hd)] for c, hd in zip(codecs, self.shapes)]
        self.stage = SideTable(num_blocks, stage_entries, device) if stage_entries else None
        self.stage_rows = [lazy_zeros(stage_entries, block_size, *hd, dtype=EXACT_DTYPE, device=device)
                           for hd in self.shapes] if stage_entries else []
        self.stage_full = torch.zeros(stage_entries, dtype=torch.bool, device=device) if stage_entries else None
        self.sink = SideTable(num_blocks, sink_entries, device) if sinks else None
        self.sink_rows = [lazy_zeros(sink_entries, sinks, *hd, dtype=EXACT_DTYPE, device=device)
                          for hd in self.shapes] if sinks else []
        self.direct = self.stage is None and all(c.per_token for c in codecs if c is not None)
        self.may_stage: torch.Tensor | None = None  # bool per block, shared with the pool; None: every block may
        self.sink_pins: torch.Tensor | None = None  # int per block, shared with the pool; None: no block is pinned
        k, v = codecs
        self.same_codec = len(self.shapes) == 2 and self.shapes[0] == self.shapes[1] and \
            type(k) is type(v) and vars(k) == vars(v)

    def tensors(self) -> list[torch.Tensor]:
        out = [t for ps in self.parts for t in ps] + self.stage_rows + self.sink_rows
        if self.stage is not None:
            out += self.stage.tensors() + [self.stage_full]
        if self.sink is not None:
            out += self.sink.tensors()
        return out

    # ---- write ------------------------------------------------------------------------------
    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
              positions: torch.Tensor | None = None) -> None:
        if self.stage is not None and self._append_staged(slots, k, v, positions):
            return
        slots = slots.long()
        rows = [k.float()] + ([v.float()] if self.shapes[1:] else [])
        if self.direct and self.sink is None:  # rows are independent and nothing else holds them
            self._store_direct(slots, rows)
            return
        blocks, offs = slots // self.bs, slots % self.bs
        new = blocks[offs == 0]
        if self.sink is not None:
            self.sink.release(new)
            if positions is not None and bool((positions < self.sinks).any()):
                self._store_sinks(blocks, offs, positions.long().to(slots.device), rows)
        self._store(blocks, offs, rows, new)

    def _store_direct(self, slots: torch.Tensor, rows: list[torch.Tensor]) -> None:
        if self.same_codec:  # one encode of K and V side by side (every parameter is per row and head)
            heads = self.shapes[0][0]
            for pk, pv, e in zip(*self.parts, self.codecs[0].encode(torch.cat(rows, 1).unsqueeze(0))):
                pk.view(-1, *pk.shape[2:])[slots] = e[0, :, :heads]
                pv.view(-1, *pv.shape[2:])[slots] = e[0, :, heads:]
            return
        for c, ps, x in zip(self.codecs, self.parts, rows):
            for p, e in zip(ps, c.encode(x.unsqueeze(0))):
                p.view(-1, *p.shape[2:])[slots] = e[0]

    def _store(self, blocks: torch.Tensor, offs: torch.Tensor, rows: list[torch.Tensor], new: torch.Tensor) -> None:
        if self.direct:
            self._store_direct(blocks * self.bs + offs, rows)
            return
        if self.stage is not None:  # rows of staged blocks first: a block they fill outside every window frees its
            self.stage.release(new)  # entry before the new blocks claim theirs
            blocks, offs, rows = self._put_into_entries(blocks, offs, rows)
            if len(blocks):
                self._claim_stage(self._windowed(new))
                blocks, offs, rows = self._put_into_entries(blocks, offs, rows)
        if len(blocks):
            self._merge(blocks, offs, rows, new)

    def _put_into_entries(self, blocks: torch.Tensor, offs: torch.Tensor, rows: list[torch.Tensor]
                          ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """Rows of blocks holding staging entries go there (a block outside every window is then encoded);
        returns the other rows."""
        e = self.stage.lookup(blocks)
        staged = e >= 0
        if bool(staged.all()):  # e.g. a decode step's rows
            self._put_staged(e, offs, rows)
            self._flush_outside_windows(blocks)
            return blocks[:0], offs[:0], [x[:0] for x in rows]
        if bool(staged.any()):
            self._put_staged(e[staged], offs[staged], [x[staged] for x in rows])
            self._flush_outside_windows(blocks[staged])
        rest = ~staged
        return blocks[rest], offs[rest], [x[rest] for x in rows]

    def _windowed(self, blocks: torch.Tensor) -> torch.Tensor:
        return blocks if self.may_stage is None else blocks[self.may_stage[blocks]]

    def _flush_outside_windows(self, blocks: torch.Tensor) -> None:
        """Staged blocks this write touched that lie in no window (e.g. filled by a long prefill chunk) are encoded."""
        if self.may_stage is None or bool(self.may_stage[blocks].all()):
            return
        self.unstage(torch.unique(blocks[~self.may_stage[blocks]]))

    def unstage(self, blocks: torch.Tensor) -> None:
        """These blocks left their request's window: those holding a staging entry are encoded from its fp16 rows
        (what the block will read as from now on) and give the entry back."""
        if self.stage is None:
            return
        e = self.stage.lookup(blocks)
        has = e >= 0
        if bool(has.any()):
            self._flush(blocks[has], e[has])
            self.stage.release(blocks[has])

    def forget_blocks(self, blocks: torch.Tensor) -> None:
        """These blocks are free: their staging and sink entries go back, nothing is encoded."""
        for table in (self.stage, self.sink):
            if table is not None:
                table.release(blocks)

    def _put_staged(self, e: torch.Tensor, offs: torch.Tensor, rows: list[torch.Tensor]) -> None:
        for s, x in zip(self.stage_rows, rows):
            s[e, offs] = x.to(EXACT_DTYPE)
        self.stage_full[e[offs == self.bs - 1]] = True

    def _append_staged(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                       positions: torch.Tensor | None) -> bool:
        """A decode step's rows: when every row lands past the first row of a block that holds a staging entry,
        and below no sink, store them there in one operator call and return True; else do nothing, return False."""
        stage_v = self.stage_rows[1] if len(self.stage_rows) > 1 else None
        return stage_append(slots, k, v, self.stage.entry_of, self.stage_rows[0], stage_v, self.stage_full, self.bs,
                            FAST_ROWS, positions, self.sinks if self.sink is not None else 0)

    def _claim_stage(self, blocks: torch.Tensor) -> Claim:
        """Give blocks empty staging entries: free ones, else (flushed to make room) entries of blocks outside every
        window, then the oldest full block's, then the oldest partial one's."""
        keep = (~self.stage_full).long() * PARTIAL_BIAS
        if self.may_stage is not None:
            keep += self.may_stage[self.stage.block_of.long().clamp_min(0)].long() * WINDOW_BIAS
        claim = self.stage.claim(blocks, keep)
        self._flush(claim.victim_blocks, claim.victim_entries)
        self.stage_full.index_fill_(0, claim.entries, False)
        for s in self.stage_rows:
            s.index_fill_(0, claim.entries, 0)
        return claim

    def _merge(self, blocks: torch.Tensor, offs: torch.Tensor, rows: list[torch.Tensor], new: torch.Tensor) -> None:
        """Rows into blocks that live only as codes: decode, insert, re-encode (new blocks start at zero). Where
        blocks stage, rows are rounded to fp16 first, so a block encoded here gets the codes its flush would give."""
        ub, inv = torch.unique(blocks, return_inverse=True)
        fresh = torch.isin(ub, new)
        full = [c.decode([p[ub] for p in ps]) for c, ps in zip(self.codecs, self.parts)]
        for x, r in zip(full, rows):
            x[fresh] = 0
            x[inv, offs] = r.to(EXACT_DTYPE).float() if self.stage is not None else r
        self._encode_into(ub, full)

    def _flush(self, blocks: torch.Tensor, entries: torch.Tensor) -> None:
        if len(blocks):
            self._encode_into(blocks, [s[entries].float() for s in self.stage_rows])

    def _encode_into(self, blocks: torch.Tensor, full: list[torch.Tensor]) -> None:
        if self.sink is not None:
            has = self.sink.lookup(blocks) >= 0
            if bool(has.any()):
                for x in full:
                    x[has, : self.sinks] = x[has, self.sinks : self.sinks + 1]
        for c, ps, x in zip(self.codecs, self.parts, full):
            for p, e in zip(ps, c.encode(x)):
                if p.dtype.itemsize == 1:  # float8 has no index_copy_; its bytes do
                    p, e = p.view(torch.uint8), e.view(torch.uint8)
                p.index_copy_(0, blocks, e)

    def _store_sinks(self, blocks: torch.Tensor, offs: torch.Tensor, positions: torch.Tensor,
                     rows: list[torch.Tensor]) -> None:
        firsts = blocks[(positions == 0) & (offs == 0)]
        if len(firsts):
            claim = self._claim_sinks(firsts)
            self._unsink(claim.victim_blocks, [s[claim.victim_entries] for s in self.sink_rows])
        e = self.sink.lookup(blocks)
        keep = (positions < self.sinks) & (offs < self.sinks) & (e >= 0)
        for s, x in zip(self.sink_rows, rows):
            s[e[keep], offs[keep]] = x[keep].to(EXACT_DTYPE)

    def _claim_sinks(self, blocks: torch.Tensor) -> Claim:
        """Sink entries for blocks: free ones, then the oldest of blocks no running request starts with."""
        pinned = None
        if self.sink_pins is not None:
            pinned = (self.sink_pins[self.sink.block_of.long().clamp_min(0)] > 0).long() * WINDOW_BIAS
        return self.sink.claim(blocks, pinned)

    def _unsink(self, blocks: torch.Tensor, exact: list[torch.Tensor]) -> None:
        """Blocks that lost their sink entry get those rows back into their ordinary storage."""
        if len(blocks):
            b = blocks.repeat_interleave(self.sinks)
            o = torch.arange(self.sinks, device=b.device).repeat(len(blocks))
            self._store(b, o, [x.flatten(0, 1).float() for x in exact], b[:0])

    def forget_rows(self, block: int, offset: int) -> None:
        """A staged block cut back below its end is no longer full, so it is not encoded until refilled."""
        if self.stage is not None and offset < self.bs:
            e = int(self.stage.lookup(torch.tensor([block], device=self.stage_full.device))[0])
            if e >= 0:
                self.stage_full[e] = False

    # ---- rows under sink entries, rewrites (compaction moves: QuantMoves in moves.py) ------------
    def _set_sink_rows(self, slots: torch.Tensor, rows: list[torch.Tensor | None]) -> None:
        """Rows written under a block's sink entry take its place there too (the entry overlays them)."""
        if self.sink is None:
            return
        blocks, offs = slots // self.bs, slots % self.bs
        e = self.sink.lookup(blocks)
        hit = (e >= 0) & (offs < self.sinks)
        for s, x in zip(self.sink_rows, rows):
            s[e[hit], offs[hit]] = x[hit].to(EXACT_DTYPE)

    def rewrite(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> None:
        """Rows under a sink entry change only there (their codes are overlaid); others are stored again."""
        slots = slots.long()
        rows = [k.float()] + ([v.float()] if self.shapes[1:] else [])
        self._set_sink_rows(slots, rows)
        if self.sink is not None:
            covered = (self.sink.lookup(slots // self.bs) >= 0) & (slots % self.bs < self.sinks)
            slots, rows = slots[~covered], [x[~covered] for x in rows]
        if len(slots):
            self._store(slots // self.bs, slots % self.bs, rows, slots[:0])

    # ---- read -------------------------------------------------------------------------------
    def gather(self, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        bids = block_ids.long()
        out = [c.decode([p.index_select(0, bids) for p in ps]) for c, ps in zip(self.codecs, self.parts)]
        for table, exact in ((self.stage, self.stage_rows), (self.sink, self.sink_rows)):
            if table is not None:
                overlay_exact(out, table.lookup(bids), exact)
        out = [x.flatten(0, 1) for x in out]
        return out[0], (out[1] if len(out) > 1 else None)

    def raw(self) -> RawKV | None:
        sides = [c.raw_side(ps) for c, ps in zip(self.codecs, self.parts)]
        if len(sides) < 2 or None in sides:
            return None
        stage = [self.stage.entry_of, *self.stage_rows] if self.stage is not None else []
        sink = [self.sink.entry_of, *self.sink_rows] if self.sink is not None else []
        return RawKV(sides[0], sides[1], stage, sink)

