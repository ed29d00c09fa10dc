"""Open an engine's tiers and build the KV connector that moves its blocks through them."""
from __future__ import annotations

import json

import torch

from kvforge.errors import ConfigError
from kvforge.kv.groups import KVGroup, StateGroup
from kvforge.kv.layer_format import KVFormat
from kvforge.kv.pool import KVPool
from kvforge.kv.pool_pair import PoolPair
from kvforge.kv.spec import KVCacheSpec
from kvforge.kv.tiers.base import Tier
from kvforge.kv.tiers.chain import TierChain
from kvforge.kv.tiers.connector import TierConnector
from kvforge.kv.tiers.keys import KeySpace, ModelKey, format_options
from kvforge.kv.tiers.parse import TierSpec


def layout_description(fmt: KVFormat, spec: KVCacheSpec, block_size: int, states: list[StateGroup] = ()) -> str:
    """What a stored entry's header names: format with options, block size and per-layer shapes; a recurrent
    model's state groups (kind, layers, shapes) too."""
    options = json.dumps(format_options(fmt), sort_keys=True)
    text = (f"{fmt.name} {options} block_size={block_size} layers={spec.num_layers} heads={spec.num_kv_heads} "
            f"dims={spec.head_dim}/{spec.v_head_dim}")
    return text + "".join(f" state {g.kind} layers={list(g.layers)} {list(g.shapes)}" for g in states)


def pin_host_memory(device: torch.device | str) -> bool:
    """Host tier payloads go in pinned (page-locked) memory when the pool is on a CUDA device that is present:
    copies to the device then run at full bus speed. On CPU pinning buys nothing, so it is off."""
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


def write_modes(tiers: list, write_through: bool | None) -> list[bool]:
    """Which tiers are write-through: all (True), none (False), or by default the shared ones (disk, Redis), so
    another engine reuses a block as soon as it is computed, while host tiers stay write-back (they extend the
    pool; a copy of what the pool still holds would only take their room)."""
    return [tier.shared if write_through is None else write_through for tier in tiers]


def check_tier_groups(tiers: list[TierSpec] | None, groups: list[KVGroup]) -> None:
    """Tiers key and store the blocks of one KV group; checked before anything is allocated or opened."""
    if tiers and len(groups) > 1:
        raise ConfigError(f"kv_tiers support models with one KV group; this model has {len(groups)} "
                          "(full and sliding-window layers); leave kv_tiers unset")


def build_tier(spec: TierSpec, description: str, pin: bool = False, fsync: bool = True) -> Tier:
    """Open the tier `spec` names; `description` (the engine's format and shapes) goes into stored headers;
    `pin`: a host tier keeps payloads in pinned memory; `fsync`: a disk tier syncs each file it writes."""
    if spec.kind == "redis":
        from kvforge.kv.tiers.redis_tier import RedisTier

        return RedisTier(spec.url, description)
    if spec.kind == "host":
        from kvforge.kv.tiers.host import HostTier

        return HostTier(spec.capacity_bytes, pin=pin)
    from kvforge.kv.tiers.disk import DiskTier

    return DiskTier(spec.path, spec.capacity_bytes, description, fsync=fsync)


def build_tiers(specs: list[TierSpec], description: str, pin: bool = False, fsync: bool = True) -> list[Tier]:
    tiers, seen = [], {}
    try:
        for spec in specs:
            tier = build_tier(spec, description, pin, fsync)
            seen[tier.name] = seen.get(tier.name, 0) + 1
            if seen[tier.name] > 1:
                tier.name = f"{tier.name}{seen[tier.name]}"
            tiers.append(tier)
    except Exception:
        for t in tiers:
            t.close()
        raise
    return tiers


def build_tier_connector(specs: list[TierSpec], groups: list[KVGroup], pool: KVPool, model: ModelKey, fmt: KVFormat,
                         write_through: bool | None = None, fsync: bool = True, device: torch.device | str = "cpu",
                         draft_pool: KVPool | None = None, states: list[StateGroup] = ()) -> TierConnector:
    """The tiers `specs` name, opened, behind a TierConnector for `pool` (on `device`). With a draft model's pool
    (indexed by the same block ids) every entry carries both models' K/V, and its key namespace (`model`, which
    names the draft) and header name the draft too. `states`: a recurrent model's state groups, whose checkpoints
    the tiers hold beside the blocks (their shapes in the namespace and header)."""
    check_tier_groups(specs, groups)
    description = layout_description(fmt, pool.spec, pool.block_size, list(states))
    block_io = pool
    if draft_pool is not None:
        description += " draft " + layout_description(fmt, draft_pool.spec, pool.block_size)
        block_io = PoolPair(pool, draft_pool)
    tiers = build_tiers(specs, description, pin=pin_host_memory(device), fsync=fsync)
    chain = TierChain(tiers, pool.block_size, write_modes(tiers, write_through))
    return TierConnector(chain, KeySpace(model, fmt, pool.block_size, pool.spec, list(states)), block_io)
