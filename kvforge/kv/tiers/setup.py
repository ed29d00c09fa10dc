"""Open an engine's tiers and hang them under its KV cache manager."""
from __future__ import annotations

import json

import torch

from kvforge.kv.layer_format import KVFormat
from kvforge.kv.pool import KVPool
from kvforge.kv.pool_pair import PoolPair
from kvforge.kv.spec import KVCacheSpec
from kvforge.kv.tiers.chain import TierChain
from kvforge.kv.tiers.keys import KeySpace, ModelKey, format_options
from kvforge.kv.tiers.spec import build_tiers


def layout_description(fmt: KVFormat, spec: KVCacheSpec, block_size: int) -> str:
    """What a stored block's header names: format with options, block size and per-layer shapes."""
    options = json.dumps(format_options(fmt), sort_keys=True)
    return (f"{fmt.name} {options} block_size={block_size} layers={spec.num_layers} heads={spec.num_kv_heads} "
            f"dims={spec.head_dim}/{spec.v_head_dim}")


def pin_host_memory(device: torch.device | str) -> bool:
    """Host tier payloads go in pinned (page-locked) memory when the pool is on a CUDA device that is present:
    copies to the device then run at full bus speed. On CPU pinning buys nothing, so it is off."""
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


def write_modes(tiers: list, write_through: bool | None) -> list[bool]:
    """Which tiers are write-through: all (True), none (False), or by default the shared ones (disk, Redis), so
    another engine reuses a block as soon as it is computed, while host tiers stay write-back (they extend the
    pool; a copy of what the pool still holds would only take their room)."""
    return [tier.shared if write_through is None else write_through for tier in tiers]


def attach_tiers(kv, tier_specs: list[str], model: ModelKey, fmt: KVFormat, spec: KVCacheSpec,
                 write_through: bool | None = None, fsync: bool = True, device: torch.device | str = "cpu",
                 draft: tuple[torch.nn.Module, KVPool] | None = None) -> TierChain:
    """With a draft model (its module and pool, indexed by the pool's block ids) every entry carries both models'
    K/V, and its key namespace and header name the draft too."""
    description = layout_description(fmt, spec, kv.block_size)
    block_io = None
    if draft is not None:
        description += " draft " + layout_description(fmt, draft[1].spec, kv.block_size)
        block_io = PoolPair(kv.pool, draft[1])
    tiers = build_tiers(tier_specs, description, pin=pin_host_memory(device), fsync=fsync)
    chain = TierChain(tiers, kv.block_size, write_modes(tiers, write_through))
    kv.attach_tiers(chain, KeySpace(model, fmt, kv.block_size, spec), block_io)
    return chain
