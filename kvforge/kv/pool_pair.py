"""PoolPair: two pools indexed by the same block ids (a target model's and its draft model's), moved as one.

A block's payload is the first pool's payload, length-prefixed, then the second's: a tier entry or a swapped
block carries both models' K/V of the same tokens, so a block loaded back is complete in both pools.
"""
from __future__ import annotations

import struct

from kvforge.kv.pool import KVPool

_LENGTH = struct.Struct("<I")


class PoolPair:
    def __init__(self, first: KVPool, second: KVPool):
        if first.num_blocks != second.num_blocks:
            raise ValueError(f"paired pools need the same block ids: {first.num_blocks} vs {second.num_blocks} blocks")
        self.first, self.second = first, second

    def export_blocks(self, block_ids: list[int]) -> list[bytes]:
        firsts, seconds = self.first.export_blocks(block_ids), self.second.export_blocks(block_ids)
        return [_LENGTH.pack(len(a)) + a + b for a, b in zip(firsts, seconds)]

    def import_blocks(self, block_ids: list[int], payloads: list[bytes]) -> None:
        """ValueError when a payload does not split into what both pools read."""
        firsts, seconds = [], []
        for payload in payloads:
            view = memoryview(payload)
            if len(view) < _LENGTH.size:
                raise ValueError(f"paired KV block payload of {len(view)} bytes has no length prefix")
            (n,) = _LENGTH.unpack_from(view)
            end = _LENGTH.size + n
            if end > len(view):
                raise ValueError(f"paired KV block payload of {len(view)} bytes names a first part of {n}")
            firsts.append(view[_LENGTH.size:end])
            seconds.append(view[end:])
        self.first.import_blocks(block_ids, firsts)
        self.second.import_blocks(block_ids, seconds)
