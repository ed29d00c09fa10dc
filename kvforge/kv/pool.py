"""KVPool: the physical block storage, shaped by spec x format x KV groups.

Storage is `group_size` layer slots of `num_blocks` blocks each; `layers[i]` is the slot that serves model
layer i (layers of different groups share a slot, and never a block id). Without groups every layer is
its own slot.
"""
from __future__ import annotations

import numpy as np
import torch

from kvforge.kv.block_bytes import stack_payloads
from kvforge.kv.groups import KVGroup
from kvforge.kv.layer_format import KVFormat
from kvforge.kv.memory import layer_slots
from kvforge.kv.spec import KVCacheSpec

LAYOUT_VERSION = 1  # the byte layout of export_blocks' payloads (tier keys name it): bump when it changes


class KVPool:
    def __init__(self, spec: KVCacheSpec, fmt: KVFormat, num_blocks: int, block_size: int, device: torch.device,
                 max_num_seqs: int = 1, groups: list[KVGroup] | None = None):
        self.spec, self.format, self.num_blocks, self.block_size = spec, fmt, num_blocks, block_size
        self.state = None  # the recurrent layers' StatePool (kv/state_pool.py), set by the manager when there are any
        seqs = max_num_seqs * (len(groups) if groups else 1)
        self.slots = [fmt.allocate(spec, num_blocks, block_size, device, seqs) for _ in range(layer_slots(spec, groups))]
        self.layers = list(self.slots)
        staged = fmt.stage_blocks(spec, block_size) > 0  # which blocks may stage, and sinks' pins: kept by the manager
        sinks = getattr(fmt, "sinks", 0) > 0
        self.share_staging(torch.zeros(num_blocks, dtype=torch.bool, device=device) if staged else None,
                           torch.zeros(num_blocks, dtype=torch.int32, device=device) if sinks else None)
        if groups:
            self.layers = [None] * spec.num_layers
            for group in groups:
                for slot, layer in enumerate(group.layers):
                    self.layers[layer] = self.slots[slot]

    def write(self, layer: int, meta, k: torch.Tensor, v: torch.Tensor | None) -> None:
        view = meta.for_layer(layer)
        self.layers[layer].write(view.slot_mapping, k, v, view.positions)

    def share_staging(self, may_stage: torch.Tensor | None, sink_pins: torch.Tensor | None) -> None:
        """Layers read which blocks may hold fp16 staging entries from `may_stage`, and how many running requests
        start with each block (whose sink entry stays) from `sink_pins` (a pool with the same block ids, e.g. a
        draft model's, shares the target's)."""
        self.may_stage, self.sink_pins = may_stage, sink_pins
        for layer in self.slots:
            layer.may_stage, layer.sink_pins = may_stage, sink_pins

    def unstage(self, block_ids: list[int]) -> None:
        """Blocks that left their request's fp16 window are stored as they will be read from now on."""
        if block_ids:
            for layer in self.slots:
                layer.unstage(self._ids(block_ids))

    def forget_blocks(self, block_ids: list[int]) -> None:
        """Freed blocks drop their side entries."""
        if block_ids:
            for layer in self.slots:
                layer.forget_blocks(self._ids(block_ids))

    def forget_rows(self, block: int, offset: int) -> None:
        """Rows from `offset` on in `block` hold nothing valid any more (a rollback)."""
        for layer in self.slots:
            layer.forget_rows(block, offset)

    def export_blocks(self, block_ids: list[int]) -> list[bytes]:
        """Each block's exact state in every layer slot, as one payload per block (slot payloads back to back);
        a block id belongs to one KV group, so its slots are exactly that group's layers. One copy per layer
        for all blocks; only blocks in a special form (staged, sinks) are put together piece by piece."""
        if not block_ids:
            return []
        if not self.slots:  # no attention layer (a recurrent model): blocks only key the prefix tree
            return [b"" for _ in block_ids]
        per_layer = [layer.export_blocks(self._ids(block_ids)) for layer in self.slots]
        table = np.concatenate([c for rows in per_layer for c in rows.columns], axis=1)
        out = [table[i].tobytes() for i in range(len(block_ids))]
        for i in set().union(*(rows.special for rows in per_layer)):
            parts, pos = [], 0
            for layer, rows in zip(self.slots, per_layer):
                width = layer.payload_bytes(0)
                parts.append(rows.special.get(i) or table[i, pos:pos + width].tobytes())
                pos += width
            out[i] = b"".join(parts)
        return out

    def import_blocks(self, block_ids: list[int], payloads: list[bytes]) -> None:
        """Make blocks hold what `export_blocks` returned; ValueError when a payload does not fit this pool.
        Plain payloads (every layer's flag 0) go in as one array, one copy per layer for all of them."""
        if not block_ids or not self.slots:
            return
        widths = [layer.payload_bytes(0) for layer in self.slots]
        starts = np.cumsum([0] + widths[:-1])
        plain_size = sum(widths)
        sized = [i for i, p in enumerate(payloads) if len(p) == plain_size]
        plain: list[int] = []
        if sized:
            table = stack_payloads([payloads[i] for i in sized])
            keep = ~table[:, starts].any(axis=1)
            plain = [i for i, k in zip(sized, keep.tolist()) if k]
            if not keep.all():
                table = table[keep]
            ids = self._ids([block_ids[i] for i in plain])
            for layer, start, width in zip(self.slots, starts, widths):
                layer.import_rows(ids, table[:, start:start + width])
        rest = sorted(set(range(len(payloads))) - set(plain))
        if rest:
            self._import_special([block_ids[i] for i in rest], [payloads[i] for i in rest])

    def _import_special(self, block_ids: list[int], payloads: list[bytes]) -> None:
        segments: list[list[memoryview]] = [[] for _ in self.slots]
        for payload in payloads:
            view, pos = memoryview(payload), 0
            for layer, out in zip(self.slots, segments):
                if pos >= len(view):
                    raise ValueError("KV block payload ends before its last layer")
                size = layer.payload_bytes(view[pos])
                out.append(view[pos:pos + size])
                pos += size
            if pos != len(view):
                raise ValueError(f"KV block payload has {len(view)} bytes, this pool's layers read {pos}")
        ids = self._ids(block_ids)
        for layer, segs in zip(self.slots, segments):
            layer.import_blocks(ids, segs)

    def _ids(self, block_ids: list[int]) -> torch.Tensor:
        return torch.tensor(block_ids, dtype=torch.long, device=self.slots[0].tensors()[0].device)

    def allocated_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.slots for t in layer.tensors())
