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

    def allocated_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer.tensors())
