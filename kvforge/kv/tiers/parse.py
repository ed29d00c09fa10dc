"""Tier strings -> TierSpec: 'host:8GiB', 'disk:PATH:100GiB', 'redis://HOST:PORT[/DB]' (order = lookup order).

Parsed once, when EngineConfig is built (and by `kvforge memory --kv-tier`); everything later takes TierSpecs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvforge.errors import ConfigError
from kvforge.units import parse_size

ALLOWED = "host:SIZE, disk:PATH:SIZE or redis://HOST:PORT[/DB] (e.g. host:8GiB, disk:/var/cache/kv:100GiB)"
KINDS = ("host", "disk", "redis")


@dataclass(frozen=True)
class TierSpec:
    kind: str  # one of KINDS
    capacity_bytes: int | None = None  # None: a Redis tier, bounded by the server's maxmemory
    path: str | None = None  # a disk tier's directory
    url: str | None = None  # a Redis tier's redis://HOST:PORT[/DB]
    text: str = field(default="", compare=False)  # the string it was parsed from, as given

    def __str__(self) -> str:
        if self.text:
            return self.text
        return self.url if self.kind == "redis" else ":".join(
            [self.kind, *([self.path] if self.kind == "disk" else []), str(self.capacity_bytes)])


def _size(text: str, tier: str) -> int:
    size = parse_size(text)
    if size <= 0:
        raise ConfigError(f"KV tier {tier!r}: the size must be positive")
    return size


def parse_tier(text: object) -> TierSpec:
    """ConfigError unless `text` is a tier string (nothing is opened); a TierSpec is returned as it is."""
    if isinstance(text, TierSpec):
        return text
    if not isinstance(text, str):
        raise ConfigError(f"a KV tier must be a string like {ALLOWED}; got {text!r}")
    if text.startswith("redis://"):
        from kvforge.kv.tiers.redis_tier import parse_redis_url

        parse_redis_url(text)
        return TierSpec("redis", url=text, text=text)
    kind, _, rest = text.partition(":")
    if kind == "host" and rest:
        return TierSpec("host", _size(rest, text), text=text)
    if kind == "disk" and ":" in rest:
        path, _, size = rest.rpartition(":")
        if not path:
            raise ConfigError(f"KV tier {text!r}: the disk tier needs a directory: disk:PATH:SIZE")
        return TierSpec("disk", _size(size, text), path=path, text=text)
    raise ConfigError(f"bad KV tier {text!r}; use {ALLOWED}")


def parse_tiers(value: object) -> list[TierSpec] | None:
    """None, one tier string, or a list of tier strings / TierSpecs -> TierSpecs (None stays None)."""
    if value is None:
        return None
    if isinstance(value, (str, TierSpec)):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"kv_tiers must be a list of tier strings like {ALLOWED}; got {value!r}")
    return [parse_tier(v) for v in value]
