"""KVPool: the physical block storage of every layer, shaped by spec x format."""
from __future__ import annotations

import torch

from kvforge.kv.layer_format import KVFormat
from kvforge.kv.spec import KVCacheSpec


class KVPool:
    def __init__(self, spec: KVCacheSpec, fmt: KVFormat, num_blocks: int, block_size: int, device: torch.device,
                 max_num_seqs: int = 1):
        self.spec, self.format, self.num_blocks, self.block_size = spec, fmt, num_blocks, block_size
        self.layers = [fmt.allocate(spec, num_blocks, block_size, device, max_num_seqs) for _ in range(spec.num_layers)]

    def write(self, layer: int, meta, k: torch.Tensor, v: torch.Tensor | None) -> None:
        self.layers[layer].write(meta.slot_mapping, k, v, meta.positions)

    def forget_rows(self, block: int, offset: int) -> None:
        """Rows from `offset` on in `block` hold nothing valid any more (a rollback)."""
        for layer in self.layers:
            layer.forget_rows(block, offset)

    def export_blocks(self, block_ids: list[int]) -> list[bytes]:
        """Each block's exact state in every layer, as one payload per block (layer payloads back to back)."""
        if not block_ids:
            return []
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.layers[0].tensors()[0].device)
        per_layer = [layer.export_blocks(ids) for layer in self.layers]
        return [b"".join(parts) for parts in zip(*per_layer)]

    def import_blocks(self, block_ids: list[int], payloads: list[bytes]) -> None:
        """Make blocks hold what `export_blocks` returned; ValueError when a payload does not fit this pool."""
        if not block_ids:
            return
        segments: list[list[memoryview]] = [[] for _ in self.layers]
        for payload in payloads:
            view, pos = memoryview(payload), 0
            for layer, out in zip(self.layers, segments):
                if pos >= len(view):
                    raise ValueError("KV block payload ends before its last layer")
                size = layer.payload_bytes(view[pos])
                out.append(view[pos:pos + size])
                pos += size
            if pos != len(view):
                raise ValueError(f"KV block payload has {len(view)} bytes, this pool's layers read {pos}")
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.layers[0].tensors()[0].device)
        for layer, segs in zip(self.layers, segments):
            layer.import_blocks(ids, segs)

    def allocated_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer.tensors())
