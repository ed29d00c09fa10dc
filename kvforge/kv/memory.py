"""The one formula for KV memory: bytes per token, per block, per request, and pool sizing.

With KV groups (kv/groups.py) a block spans `group_size` layer slots and a sequence holds blocks in every
group; without groups (None) a block spans every layer and a sequence holds one table. Recurrent layers add a
fixed `state_bytes` per sequence (kv/groups.py `state_bytes_per_sequence`): the state pool holds one slot per
sequence the engine may run, in the same budget, like a format's side buffers.
"""
from __future__ import annotations

import math

from kvforge.kv.formats import KVFormat
from kvforge.kv.groups import KVGroup, group_size, sequence_blocks
from kvforge.kv.spec import KVCacheSpec


def layer_slots(spec: KVCacheSpec, groups: list[KVGroup] | None) -> int:
    return group_size(groups) if groups else spec.num_layers


def bytes_per_block(spec: KVCacheSpec, fmt: KVFormat, block_size: int, groups: list[KVGroup] | None = None) -> int:
    """Bytes one block id occupies across its layer slots."""
    return layer_slots(spec, groups) * fmt.layer_block_bytes(spec, block_size)


def bytes_per_token(spec: KVCacheSpec, fmt: KVFormat, block_size: int = 16) -> float:
    """Bytes one cached token costs across all layers (amortised over a full block)."""
    return bytes_per_block(spec, fmt, block_size) / block_size


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return math.ceil(num_tokens / block_size)


def blocks_for_sequence(num_tokens: int, block_size: int, groups: list[KVGroup] | None = None) -> int:
    """Blocks a sequence of num_tokens holds (over all groups; sliding groups only their window's)."""
    return sequence_blocks(groups, num_tokens, block_size) if groups else blocks_for_tokens(num_tokens, block_size)


def bytes_for_sequence(spec: KVCacheSpec, fmt: KVFormat, num_tokens: int, block_size: int,
                       groups: list[KVGroup] | None = None) -> int:
    """Bytes a sequence of num_tokens really holds: whole blocks, the last one partly empty."""
    return blocks_for_sequence(num_tokens, block_size, groups) * bytes_per_block(spec, fmt, block_size, groups)


def side_bytes(spec: KVCacheSpec, fmt: KVFormat, block_size: int, max_num_seqs: int = 1,
               groups: list[KVGroup] | None = None, state_bytes: int = 0) -> int:
    """Fixed bytes kept beside the blocks: a format's (e.g. fp16 residual windows, all layer slots; a slot
    serves one block per sequence in each group) and the recurrent state of max_num_seqs sequences."""
    seqs = max_num_seqs * (len(groups) if groups else 1)
    return layer_slots(spec, groups) * fmt.side_bytes(spec, block_size, seqs) + max_num_seqs * state_bytes


def sequences_for_budget(spec: KVCacheSpec, fmt: KVFormat, block_size: int, budget_bytes: int, max_num_seqs: int,
                         share: float, groups: list[KVGroup] | None = None, per_sequence_extra: int = 0) -> int:
    """How many sequences an engine runs at once under a budget: max_num_seqs, fewer (at least 1) when their side
    buffers (fp16 windows, sinks) would take more than `share` of it, so that the blocks keep the rest.
    `per_sequence_extra`: a draft model's side bytes per sequence."""
    per_seq = side_bytes(spec, fmt, block_size, 1, groups) + per_sequence_extra
    if per_seq == 0:
        return max_num_seqs
    return max(1, min(max_num_seqs, int(budget_bytes * share // per_seq)))


def num_blocks_for_budget(spec: KVCacheSpec, fmt: KVFormat, block_size: int, budget_bytes: int,
                          max_num_seqs: int = 1, groups: list[KVGroup] | None = None, state_bytes: int = 0) -> int:
    """Blocks that fit a budget after the side buffers and states of max_num_seqs sequences (a model without
    attention layers has blocks of no bytes: -1 when its states fit, 0 when they do not)."""
    usable = budget_bytes - side_bytes(spec, fmt, block_size, max_num_seqs, groups, state_bytes)
    per_block = bytes_per_block(spec, fmt, block_size, groups)
    if per_block == 0:
        return -1 if usable >= 0 else 0
    return max(0, int(usable // per_block))


def pool_bytes(spec: KVCacheSpec, fmt: KVFormat, block_size: int, num_blocks: int, max_num_seqs: int = 1,
               groups: list[KVGroup] | None = None, state_bytes: int = 0) -> int:
    """Exactly what a pool of num_blocks (and a state pool of max_num_seqs slots) allocates."""
    return (num_blocks * bytes_per_block(spec, fmt, block_size, groups)
            + side_bytes(spec, fmt, block_size, max_num_seqs, groups, state_bytes))


def budget_for(spec: KVCacheSpec, fmt: KVFormat, block_size: int, tokens_per_seq: int, num_seqs: int = 1,
               spare_blocks: int = 0, groups: list[KVGroup] | None = None, state_bytes: int = 0) -> int:
    """The smallest budget that holds num_seqs sequences of tokens_per_seq (plus spare blocks)."""
    blocks = num_seqs * blocks_for_sequence(tokens_per_seq, block_size, groups) + spare_blocks
    return pool_bytes(spec, fmt, block_size, blocks, num_seqs, groups, state_bytes)


def sequences_that_fit(spec: KVCacheSpec, fmt: KVFormat, block_size: int, budget_bytes: int, seq_len: int,
                       groups: list[KVGroup] | None = None, state_bytes: int = 0) -> int:
    """How many sequences of seq_len tokens a budget holds, side buffers and recurrent states included (they grow
    linearly in sequences)."""
    return int(budget_bytes // budget_for(spec, fmt, block_size, seq_len, 1, groups=groups, state_bytes=state_bytes))


CHECKPOINT_SHARE = 8  # a recurrent model with prefix caching keeps state checkpoints in 1/8 of its KV budget


def checkpoint_budget(budget_bytes: int, state_bytes: int, given: int | None = None) -> int:
    """Bytes of a KV budget that hold recurrent state checkpoints (kv/state_checkpoints.py): `given`, else
    1/CHECKPOINT_SHARE of it; none without recurrent layers."""
    if not state_bytes:
        return 0
    return budget_bytes // CHECKPOINT_SHARE if given is None else given
