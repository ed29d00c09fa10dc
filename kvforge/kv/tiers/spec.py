"""Tier strings -> tiers: 'host:8GiB', 'disk:PATH:100GiB', 'redis://HOST:PORT[/DB]' (order = lookup order)."""
from __future__ import annotations

from kvforge.errors import ConfigError
from kvforge.kv.tiers.base import Tier

ALLOWED = "host:SIZE, disk:PATH:SIZE or redis://HOST:PORT[/DB] (e.g. host:8GiB, disk:/var/cache/kv:100GiB)"


def _size(text: str, tier: str) -> int:
    from kvforge.memcalc import parse_size

    size = parse_size(text)
    if size <= 0:
        raise ConfigError(f"KV tier {tier!r}: the size must be positive")
    return size


def check_tier_spec(text: object) -> None:
    """Raise ConfigError unless `text` is a tier string (checked at configuration time, nothing opened)."""
    if not isinstance(text, str):
        raise ConfigError(f"a KV tier must be a string like {ALLOWED}; got {text!r}")
    if text.startswith("redis://"):
        from kvforge.kv.tiers.redis_tier import parse_redis_url

        parse_redis_url(text)
        return
    kind, _, rest = text.partition(":")
    if kind == "host" and rest:
        _size(rest, text)
    elif kind == "disk" and ":" in rest:
        path, _, size = rest.rpartition(":")
        if not path:
            raise ConfigError(f"KV tier {text!r}: the disk tier needs a directory: disk:PATH:SIZE")
        _size(size, text)
    else:
        raise ConfigError(f"bad KV tier {text!r}; use {ALLOWED}")


def build_tier(text: str, description: str, pin: bool = False, fsync: bool = True) -> Tier:
    """Open the tier `text` names; `description` (the engine's format and shapes) goes into stored headers;
    `pin`: a host tier keeps payloads in pinned memory; `fsync`: a disk tier syncs each file it writes."""
    check_tier_spec(text)
    if text.startswith("redis://"):
        from kvforge.kv.tiers.redis_tier import RedisTier

        return RedisTier(text, description)
    kind, _, rest = text.partition(":")
    if kind == "host":
        from kvforge.kv.tiers.host import HostTier

        return HostTier(_size(rest, text), pin=pin)
    from kvforge.kv.tiers.disk import DiskTier

    path, _, size = rest.rpartition(":")
    return DiskTier(path, _size(size, text), description, fsync=fsync)


def build_tiers(texts: list[str], description: str, pin: bool = False, fsync: bool = True) -> list[Tier]:
    tiers, seen = [], {}
    try:
        for text in texts:
            tier = build_tier(text, description, pin, fsync)
            seen[tier.name] = seen.get(tier.name, 0) + 1
            if seen[tier.name] > 1:
                tier.name = f"{tier.name}{seen[tier.name]}"
            tiers.append(tier)
    except Exception:
        for t in tiers:
            t.close()
        raise
    return tiers
