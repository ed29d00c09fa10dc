"""The one formula for KV memory: bytes per token, per block, per request, and pool sizing."""
from __future__ import annotations

import math

from kvforge.kv.formats import KVFormat
from kvforge.kv.spec import KVCacheSpec


def bytes_per_block(spec: KVCacheSpec, fmt: KVFormat, block_size: int) -> int:
    """Bytes one block occupies across all layers."""
    return spec.num_layers * fmt.layer_block_bytes(spec, block_size)


def bytes_per_token(spec: KVCacheSpec, fmt: KVFormat, block_size: int = 16) -> float:
    """Bytes one cached token costs across all layers (amortised over a full block)."""
    return bytes_per_block(spec, fmt, block_size) / block_size


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return math.ceil(num_tokens / block_size)


def bytes_for_sequence(spec: KVCacheSpec, fmt: KVFormat, num_tokens: int, block_size: int) -> int:
    """Bytes a sequence of num_tokens really holds: whole blocks, the last one partly empty."""
    return blocks_for_tokens(num_tokens, block_size) * bytes_per_block(spec, fmt, block_size)


def num_blocks_for_budget(spec: KVCacheSpec, fmt: KVFormat, block_size: int, budget_bytes: int) -> int:
    return int(budget_bytes // bytes_per_block(spec, fmt, block_size))
