"""How the KV budget is spent at engine build: state checkpoints, per-sequence staging, state slots and blocks, and
the max_model_len one sequence may reach in the blocks left (capped to what fits when the user did not set it)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvforge.config import EngineConfig
from kvforge.engine.speculative.draft_model import shared_num_blocks
from kvforge.errors import ConfigError
from kvforge.kv.groups import KVGroup
from kvforge.kv.layer_format import KVFormat
from kvforge.kv.memory import (
    blocks_for_tokens,
    bytes_per_block,
    checkpoint_budget,
    num_blocks_for_budget,
    sequences_for_budget,
    side_bytes,
)
from kvforge.kv.spec import KVCacheSpec


@dataclass(frozen=True)
class KVSizing:
    budget_bytes: int  # the whole KV budget, as asked or from the free memory
    checkpoint_bytes: int  # of it, for recurrent state checkpoints
    max_num_seqs: int  # sequences that run at once (fewer than asked where staging would crowd out blocks)
    num_blocks: int
    max_model_len: int
    capped_from: int | None  # the model's context, when the budget capped max_model_len


def size_kv(c: EngineConfig, spec: KVCacheSpec, fmt: KVFormat, groups: list[KVGroup], draft: KVCacheSpec | None,
            state_bytes: int, evicts: bool, max_model_len: int, device: torch.device) -> KVSizing:
    budget = c.kv_cache_memory
    if budget is None:
        budget = int(free_memory_bytes(device) * c.kv_cache_memory_fraction)
    checkpoints = _checkpoint_budget(c, budget, state_bytes, evicts)
    rest = budget - checkpoints
    draft_side = side_bytes(draft, fmt, c.block_size, 1) if draft else 0
    # a format's fp16 windows are per running sequence: as many as the budget can run beside its blocks
    seqs = sequences_for_budget(spec, fmt, c.block_size, rest, c.max_num_seqs, c.kv_staging_share, groups, draft_side)
    if draft is None:
        num_blocks = num_blocks_for_budget(spec, fmt, c.block_size, rest, seqs, groups, state_bytes)
        if num_blocks < 0:  # no attention layer: blocks cost nothing, they only key the prefix tree
            num_blocks = 2 * seqs * blocks_for_tokens(max_model_len, c.block_size)
    else:  # each block also holds the draft model's K/V of the same tokens
        num_blocks = shared_num_blocks(spec, groups, draft, fmt, c.block_size, rest, seqs)
    capped_from, need = None, blocks_one_sequence(c, groups, max_model_len)
    if num_blocks < need and c.max_model_len is None and num_blocks > 0:
        lengths = range(c.block_size, max_model_len + 1, c.block_size)
        fits = max((n for n in lengths if blocks_one_sequence(c, groups, n) <= num_blocks), default=0)
        if fits:  # the model's full context does not fit: cap it
            capped_from, max_model_len, need = max_model_len, fits, blocks_one_sequence(c, groups, fits)
    if num_blocks < need or num_blocks == 0:
        per_block = bytes_per_block(spec, fmt, c.block_size, groups)
        per_block += bytes_per_block(draft, fmt, c.block_size) if draft else 0
        if state_bytes and num_blocks == 0:
            kept = f" (after {checkpoints} for state checkpoints)" if checkpoints else ""
            raise ConfigError(f"a KV budget of {rest} bytes{kept} does not hold the recurrent state of "
                              f"max_num_seqs={seqs} sequences ({state_bytes} bytes each) and one "
                              "block; raise kv_cache_memory or lower max_num_seqs")
        raise ConfigError(
            f"a KV budget of {rest} bytes holds {num_blocks} blocks of {c.block_size} tokens, but one sequence of "
            f"max_model_len={max_model_len} needs {need} ({need * per_block} bytes); "
            "raise kv_cache_memory or lower max_model_len")
    return KVSizing(budget, checkpoints, seqs, num_blocks, max_model_len, capped_from)


def _checkpoint_budget(c: EngineConfig, budget: int, state_bytes: int, evicts: bool) -> int:
    """Bytes of the KV budget that hold recurrent state checkpoints (prefix caching on a recurrent model)."""
    if not state_bytes or not c.enable_prefix_caching or c.kv_layout != "paged" or evicts:
        return 0  # the same conditions as the manager's prefix tree
    share = checkpoint_budget(budget, state_bytes, c.state_checkpoint_memory)
    if share > budget:
        raise ConfigError(f"state_checkpoint_memory={share} is more than the KV budget of {budget} bytes")
    return share


def blocks_one_sequence(c: EngineConfig, groups: list[KVGroup], length: int) -> int:
    """Blocks one sequence of `length` tokens may hold at once: a sliding group holds its window plus the
    step's new tokens (a prefill chunk of up to max_num_batched_tokens), not more than the whole length."""
    whole = blocks_for_tokens(length, c.block_size)
    if c.kv_layout == "contiguous":
        return whole * len(groups)
    return sum(min(whole, blocks_for_tokens(g.window + c.max_num_batched_tokens, c.block_size) + 1)
               if g.sliding else whole for g in groups)


def budget_split(c: EngineConfig, sizing: KVSizing, spec: KVCacheSpec, fmt: KVFormat, groups: list[KVGroup],
                 draft: KVCacheSpec | None, block_bytes: int, num_blocks: int, state_bytes: int) -> dict:
    """Where the KV budget went: blocks (the draft model's K/V included), per-sequence staging (fp16 windows and
    sinks of `kv_staging_sequences` running sequences), recurrent state slots and checkpoints, and the rest (less
    than one block, unallocated)."""
    seqs = sizing.max_num_seqs
    per_block = block_bytes + (bytes_per_block(draft, fmt, c.block_size) if draft else 0)
    staging = side_bytes(spec, fmt, c.block_size, seqs, groups)
    staging += side_bytes(draft, fmt, c.block_size, seqs) if draft else 0
    blocks = num_blocks * per_block
    states = state_bytes * seqs  # recurrent layers' state slots, one per running sequence
    return {"kv_budget_bytes": sizing.budget_bytes, "kv_block_bytes_total": blocks, "kv_staging_bytes": staging,
            "kv_staging_sequences": seqs if staging else 0, "kv_state_slot_bytes": states,
            "kv_state_checkpoint_bytes": sizing.checkpoint_bytes,
            "kv_other_bytes": sizing.budget_bytes - blocks - staging - states - sizing.checkpoint_bytes,
            "max_num_seqs": seqs, "max_num_seqs_asked": c.max_num_seqs}


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return info.get("MemAvailable", info["MemFree"])
