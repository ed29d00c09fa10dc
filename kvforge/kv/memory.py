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


def side_bytes(spec: KVCacheSpec, fmt: KVFormat, block_size: int, max_num_seqs: int = 1) -> int:
    """Fixed bytes a format keeps beside its blocks (e.g. fp16 residual windows), all layers."""
    return spec.num_layers * fmt.side_bytes(spec, block_size, max_num_seqs)


def num_blocks_for_budget(spec: KVCacheSpec, fmt: KVFormat, block_size: int, budget_bytes: int,
                          max_num_seqs: int = 1) -> int:
    """Blocks that fit a budget after the format's side buffers for max_num_seqs sequences."""
    usable = budget_bytes - side_bytes(spec, fmt, block_size, max_num_seqs)
    return max(0, int(usable // bytes_per_block(spec, fmt, block_size)))


def pool_bytes(spec: KVCacheSpec, fmt: KVFormat, block_size: int, num_blocks: int, max_num_seqs: int = 1) -> int:
    """Exactly what a pool of num_blocks allocates."""
    return num_blocks * bytes_per_block(spec, fmt, block_size) + side_bytes(spec, fmt, block_size, max_num_seqs)


def budget_for(spec: KVCacheSpec, fmt: KVFormat, block_size: int, tokens_per_seq: int, num_seqs: int = 1,
               spare_blocks: int = 0) -> int:
    """The smallest budget that holds num_seqs sequences of tokens_per_seq (plus spare blocks)."""
    blocks = num_seqs * blocks_for_tokens(tokens_per_seq, block_size) + spare_blocks
    return pool_bytes(spec, fmt, block_size, blocks, num_seqs)


def sequences_that_fit(spec: KVCacheSpec, fmt: KVFormat, block_size: int, budget_bytes: int, seq_len: int) -> int:
    """How many sequences of seq_len tokens a budget holds, side buffers included (they grow linearly in sequences)."""
    return int(budget_bytes // budget_for(spec, fmt, block_size, seq_len, 1))
