"""RedisTier: block entries in a Redis server shared by every engine that points at it (redis-py client).

One Redis key per block, 'kvforge:<group>-<hex digest>', whose value is the whole entry (header with key,
format and checksum, then the payload), so Redis's own eviction drops both or neither. Lookups, reads and
writes are batched in one pipeline or MGET per call. The key's namespace (weights, format, options, block
size, salt) is inside the digest, so engines of different models or tenants never share an entry.
Errors (server down, killed, slow) raise to the chain, which counts them and reads them as misses. Swap keys
(private) get a TTL, so one whose discard never arrives does not stay forever.
"""
from __future__ import annotations

import logging
import re

from kvforge.errors import ConfigError
from kvforge.kv.tiers.base import Tier
from kvforge.kv.tiers.entry import CorruptEntry, pack, unpack
from kvforge.kv.tiers.keys import BlockKey

PREFIX = "kvforge:"
TIMEOUT_S = 1.0
PRIVATE_TTL_S = 3600  # a swapped request's blocks expire if their discard never comes (the engine died)
log = logging.getLogger("kvforge.kv.tiers")
_URL = re.compile(r"redis://(?P<host>[^:/]+):(?P<port>\d+)(?:/(?P<db>\d+))?/?")


def parse_redis_url(url: str) -> tuple[str, int, int]:
    m = _URL.fullmatch(url)
    if m is None or not 0 < int(m["port"]) < 65536:
        raise ConfigError(f"bad Redis tier {url!r}; use redis://HOST:PORT or redis://HOST:PORT/DB (e.g. redis://127.0.0.1:6379/0)")
    return m["host"], int(m["port"]), int(m["db"] or 0)


def redis_key(key: BlockKey) -> str:
    return PREFIX + key.name


class RedisTier(Tier):
    name = "redis"
    shared = True
    remote = True

    def __init__(self, url: str, description: str, timeout_s: float = TIMEOUT_S):
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError:
            raise ConfigError("the Redis KV tier needs the redis package: pip install redis") from None
        host, port, db = parse_redis_url(url)
        self.url, self.description = url, description
        self.corrupt_entries = 0
        self.client = redis.Redis(host=host, port=port, db=db, socket_timeout=timeout_s,
                                  socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0))
        self._stored = 0

    def contains(self, keys):
        pipe = self.client.pipeline(transaction=False)
        for k in keys:
            pipe.exists(redis_key(k))
        return [bool(n) for n in pipe.execute()]

    def get(self, keys):
        values = self.client.mget([redis_key(k) for k in keys]) if keys else []
        out, bad = [], []
        for k, v in zip(keys, values):
            if v is None:
                out.append(None)
                continue
            try:
                out.append(unpack(k, v, self.description))
            except CorruptEntry as e:
                log.warning("KV redis tier: %s; entry deleted", e)
                self.corrupt_entries += 1
                bad.append(redis_key(k))
                out.append(None)
        if bad:
            self.client.delete(*bad)
        return out

    def put(self, items, private=frozenset()):
        pipe = self.client.pipeline(transaction=False)
        for k, payload in items:
            pipe.set(redis_key(k), pack(k, payload, self.description), ex=PRIVATE_TTL_S if k in private else None)
        pipe.execute()
        self._stored += sum(len(p) for _, p in items)
        return []

    def discard(self, keys):
        if keys:
            self.client.delete(*[redis_key(k) for k in keys])

    def used_bytes(self):
        """Bytes this engine has written (Redis may have evicted some; its own used_memory is server-wide)."""
        return self._stored

    def close(self):
        self.client.close()
