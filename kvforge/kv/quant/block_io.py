"""Lossless export and import of quantized blocks (tiers, swap), as a mixin of QuantLayerKV.

A payload is a flag byte, then either the block's codes or, while the block still sits in an fp16
staging entry, those exact staged rows (STAGED; STAGE_FULL says the entry was full), then the block's
exact sink rows when it holds a sink entry (SINKS). Importing claims entries the way a write does
(their previous holders are flushed or unsinked), so the block reads back bit for bit as it was; a staged
block imported outside every window (`may_stage`) is encoded from its rows, as its flush would have.
"""
from __future__ import annotations

import numpy as np
import torch

from kvforge.kv.block_bytes import (
    LayerRows,
    flag_column,
    nbytes,
    put_rows,
    rows_as_bytes,
    stack_payloads,
    tensor_from_columns,
)

STAGED, STAGE_FULL, SINKS = 1, 2, 4


class QuantBlockIO:
    """Needs QuantLayerKV's attributes: bs, sinks, shapes, parts, stage, stage_rows, stage_full, sink, sink_rows."""

    def _code_bytes(self) -> int:
        return sum(nbytes(p.shape[1:], p.dtype) for ps in self.parts for p in ps)

    def _rows_bytes(self, rows: list[torch.Tensor]) -> int:
        return sum(nbytes(r.shape[1:], r.dtype) for r in rows)

    def payload_bytes(self, flag: int) -> int:
        body = self._rows_bytes(self.stage_rows) if flag & STAGED else self._code_bytes()
        return 1 + body + (self._rows_bytes(self.sink_rows) if flag & SINKS else 0)

    def export_blocks(self, block_ids: torch.Tensor) -> LayerRows:
        ids = block_ids.long()
        codes = [rows_as_bytes(p.index_select(0, ids)) for ps in self.parts for p in ps]
        flags: dict[int, int] = {}
        staged_rows, sink_rows = {}, {}
        if self.stage is not None:
            e = self.stage.lookup(ids)
            for i in torch.nonzero(e >= 0).flatten().tolist():
                flags[i] = STAGED | (STAGE_FULL if bool(self.stage_full[e[i]]) else 0)
                staged_rows[i] = _entry_bytes(self.stage_rows, int(e[i]))
        if self.sink is not None:
            e = self.sink.lookup(ids)
            for i in torch.nonzero(e >= 0).flatten().tolist():
                flags[i] = flags.get(i, 0) | SINKS
                sink_rows[i] = _entry_bytes(self.sink_rows, int(e[i]))
        special = {i: bytes([f]) + (staged_rows[i] if i in staged_rows else b"".join(c[i].tobytes() for c in codes))
                   + sink_rows.get(i, b"") for i, f in flags.items()}
        return LayerRows([flag_column(len(ids))] + codes, special)

    def import_blocks(self, block_ids: torch.Tensor, payloads: list[bytes | memoryview]) -> None:
        ids = block_ids.long()
        flags = [p[0] for p in payloads]
        self._release_entries(ids)
        coded = [i for i, f in enumerate(flags) if not f & STAGED]
        if coded:
            self._import_codes(ids[coded], stack_payloads([payloads[i] for i in coded], 0, self.payload_bytes(0)))
        sinked = [i for i, f in enumerate(flags) if f & SINKS]
        if sinked:  # before staged rows, so that a staged block encoded here leaves its sinks out, as a flush does
            self._import_sinks(ids[sinked], [payloads[i] for i in sinked])
        staged = [i for i, f in enumerate(flags) if f & STAGED]
        if staged:
            self._import_staged(ids[staged], [payloads[i] for i in staged])

    def import_rows(self, block_ids: torch.Tensor, table: np.ndarray) -> None:
        ids = block_ids.long()
        self._release_entries(ids)
        self._import_codes(ids, table)

    def _release_entries(self, ids: torch.Tensor) -> None:
        for table in (self.stage, self.sink):
            if table is not None:
                table.release(ids)  # entries a previous holder of these block ids left behind

    def _read_rows(self, table: np.ndarray, start: int, rows: list[torch.Tensor]) -> list[torch.Tensor]:
        out, pos = [], start
        for r in rows:
            out.append(tensor_from_columns(table, pos, r.shape[1:], r.dtype, r.device))
            pos += nbytes(r.shape[1:], r.dtype)
        return out

    def _import_codes(self, ids: torch.Tensor, table: np.ndarray) -> None:
        flat = [p for ps in self.parts for p in ps]
        for p, x in zip(flat, self._read_rows(table, 1, flat)):
            put_rows(p, ids, x)

    def _import_staged(self, ids: torch.Tensor, payloads) -> None:
        rows = self._read_rows(stack_payloads(payloads, 0, 1 + self._rows_bytes(self.stage_rows)), 1, self.stage_rows)
        if self.stage is None:  # this pool stages nothing: keep the rows as codes, as a flush would
            self._encode_into(ids, [r.float() for r in rows])
            return
        full = torch.tensor([bool(p[0] & STAGE_FULL) for p in payloads], device=self.stage_full.device)
        windowed = self.may_stage[ids] if self.may_stage is not None else torch.ones_like(full)
        claim = self._claim_stage(ids[windowed])
        taken = torch.zeros_like(full)
        taken[windowed.nonzero()[:, 0]] = claim.taken
        for s, r in zip(self.stage_rows, rows):
            s[claim.entries] = r[taken]
        self.stage_full[claim.entries] = full[taken]
        short = ~taken  # outside every window (a prefix loaded from a tier), or no entry left: encoded, as a flush
        if bool(short.any()):
            self._encode_into(ids[short], [r[short].float() for r in rows])

    def _import_sinks(self, ids: torch.Tensor, payloads) -> None:
        rows = self._read_rows(self._sink_table(payloads), 0, self.sink_rows)
        claim = self._claim_sinks(ids)
        self._unsink(claim.victim_blocks, [s[claim.victim_entries] for s in self.sink_rows])
        for s, r in zip(self.sink_rows, rows):
            s[claim.entries] = r[claim.taken]
        short = ~claim.taken
        if bool(short.any()):
            self._unsink(ids[short], [r[short] for r in rows])

    def _sink_table(self, payloads) -> np.ndarray:
        width = self._rows_bytes(self.sink_rows)
        return np.stack([np.frombuffer(bytes(p[self.payload_bytes(p[0] & ~SINKS):][:width]), np.uint8) for p in payloads])


def _entry_bytes(rows: list[torch.Tensor], entry: int) -> bytes:
    return b"".join(rows_as_bytes(s[entry:entry + 1])[0].tobytes() for s in rows)
