"""Lossless export and import of quantized blocks (tiers, swap), as a mixin of QuantLayerKV.

A payload is a flag byte, then either the block's codes or, while the block still sits in an fp16
staging entry, those exact staged rows (STAGED; STAGE_FULL says the entry was full), then the block's
exact sink rows when it holds a sink entry (SINKS). Importing claims entries the way a write does
(their previous holders are flushed or unsinked), so the block reads back bit for bit as it was.
"""
from __future__ import annotations

import numpy as np
import torch

from kvforge.kv.block_bytes import nbytes, rows_as_bytes, tensor_from_bytes

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

    def export_blocks(self, block_ids: torch.Tensor) -> list[bytes]:
        ids = block_ids.long()
        n = len(ids)
        codes = np.concatenate([rows_as_bytes(p.index_select(0, ids)) for ps in self.parts for p in ps], axis=1)
        flags = np.zeros(n, dtype=np.uint8)
        staged_rows, sink_rows = {}, {}
        if self.stage is not None:
            e = self.stage.lookup(ids)
            for i in torch.nonzero(e >= 0).flatten().tolist():
                flags[i] |= STAGED | (STAGE_FULL if bool(self.stage_full[e[i]]) else 0)
                staged_rows[i] = b"".join(rows_as_bytes(s[e[i]:e[i] + 1])[0].tobytes() for s in self.stage_rows)
        if self.sink is not None:
            e = self.sink.lookup(ids)
            for i in torch.nonzero(e >= 0).flatten().tolist():
                flags[i] |= SINKS
                sink_rows[i] = b"".join(rows_as_bytes(s[e[i]:e[i] + 1])[0].tobytes() for s in self.sink_rows)
        return [bytes([flags[i]]) + (staged_rows[i] if i in staged_rows else codes[i].tobytes()) + sink_rows.get(i, b"")
                for i in range(n)]

    def import_blocks(self, block_ids: torch.Tensor, payloads: list[bytes | memoryview]) -> None:
        ids = block_ids.long()
        flags = [p[0] for p in payloads]
        for table in (self.stage, self.sink):
            if table is not None:
                table.release(ids)  # entries a previous holder of these block ids left behind
        coded = [i for i, f in enumerate(flags) if not f & STAGED]
        if coded:
            self._import_codes(ids[coded], [payloads[i] for i in coded])
        staged = [i for i, f in enumerate(flags) if f & STAGED]
        if staged:
            self._import_staged(ids[staged], [payloads[i] for i in staged])
        sinked = [i for i, f in enumerate(flags) if f & SINKS]
        if sinked:
            self._import_sinks(ids[sinked], [payloads[i] for i in sinked])

    def _read_rows(self, payloads, start: int, rows: list[torch.Tensor]) -> list[torch.Tensor]:
        out, pos = [], start
        for r in rows:
            size = nbytes(r.shape[1:], r.dtype)
            data = b"".join(bytes(p[pos:pos + size]) for p in payloads)
            out.append(tensor_from_bytes(data, (len(payloads), *r.shape[1:]), r.dtype, r.device))
            pos += size
        return out

    def _import_codes(self, ids: torch.Tensor, payloads) -> None:
        flat = [p for ps in self.parts for p in ps]
        for p, x in zip(flat, self._read_rows(payloads, 1, flat)):
            p[ids] = x

    def _import_staged(self, ids: torch.Tensor, payloads) -> None:
        rows = self._read_rows(payloads, 1, self.stage_rows)
        if self.stage is None:  # this pool stages nothing: keep the rows as codes, as a flush would
            self._encode_into(ids, [r.float() for r in rows])
            return
        full = torch.tensor([bool(p[0] & STAGE_FULL) for p in payloads], device=self.stage_full.device)
        claim = self._claim_stage(ids)
        for s, r in zip(self.stage_rows, rows):
            s[claim.entries] = r[claim.taken]
        self.stage_full[claim.entries] = full[claim.taken]
        short = ~claim.taken
        if bool(short.any()):
            self._encode_into(ids[short], [r[short].float() for r in rows])

    def _import_sinks(self, ids: torch.Tensor, payloads) -> None:
        rows = self._read_rows([p[self.payload_bytes(p[0] & ~SINKS):] for p in payloads], 0, self.sink_rows)
        claim = self.sink.claim(ids)
        self._unsink(claim.victim_blocks, [s[claim.victim_entries] for s in self.sink_rows])
        for s, r in zip(self.sink_rows, rows):
            s[claim.entries] = r[claim.taken]
        short = ~claim.taken
        if bool(short.any()):
            self._unsink(ids[short], [r[short] for r in rows])
