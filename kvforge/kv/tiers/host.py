"""HostTier: block payloads in process memory under a byte budget, least recently used pushed out first.

With `pin` (the pool is on a CUDA device) each payload is copied once into pinned memory, so its way to the
device is a DMA at full bus speed; readers get a memoryview of it. On CPU payloads stay the bytes they came as.
"""
from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from kvforge.kv.tiers.base import Tier
from kvforge.kv.tiers.keys import BlockKey


class HostTier(Tier):
    name = "host"

    def __init__(self, capacity_bytes: int, pin: bool = False):
        self.capacity_bytes, self.pin = capacity_bytes, pin
        self._entries: OrderedDict[BlockKey, bytes] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()

    def contains(self, keys):
        """A hit counts as a use: the entry moves to the recent end, so a load that follows finds it still here."""
        with self._lock:
            out = [k in self._entries for k in keys]
            for k, hit in zip(keys, out):
                if hit:
                    self._entries.move_to_end(k)
            return out

    def get(self, keys):
        with self._lock:
            out = []
            for k in keys:
                v = self._entries.get(k)
                if v is not None:
                    self._entries.move_to_end(k)
                out.append(v)
            return out

    def put(self, items, private=frozenset()):
        pushed: list[tuple[BlockKey, bytes]] = []
        with self._lock:
            for key, payload in items:
                if len(payload) > self.capacity_bytes:
                    pushed.append((key, payload))
                    continue
                if self.pin:
                    payload = _pinned(payload)
                old = self._entries.pop(key, None)
                self._used -= len(old) if old is not None else 0
                self._entries[key] = payload
                self._used += len(payload)
                while self._used > self.capacity_bytes:
                    k, v = self._entries.popitem(last=False)
                    self._used -= len(v)
                    pushed.append((k, v))
        return pushed

    def discard(self, keys):
        with self._lock:
            for k in keys:
                v = self._entries.pop(k, None)
                self._used -= len(v) if v is not None else 0

    def items(self) -> list[tuple[BlockKey, bytes]]:
        """What the tier holds, most recently used first."""
        with self._lock:
            return list(reversed(self._entries.items()))

    def used_bytes(self):
        return self._used

    def __len__(self) -> int:
        return len(self._entries)


def _pinned(payload) -> memoryview:
    buf = torch.empty(len(payload), dtype=torch.uint8).pin_memory()
    buf.numpy()[:] = memoryview(payload).cast("B")
    return memoryview(buf.numpy())
