"""TierChain: the ordered tiers below the pool, and the worker thread that stores blocks off the step loop.

Stores are queued; until the worker has written a block it stays in `pending`, where lookups and loads
find it, so a queued store is never a miss and a failed one is never visible. A tier that fills pushes
its least recently used entries down to the next tier (the last one drops them). Any tier error is
counted, logged once per tier, and read as a miss: the request recomputes, serving goes on.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from kvforge.kv.tiers.base import Tier
from kvforge.kv.tiers.keys import BlockKey
from kvforge.kv.tiers.stats import TierStats

log = logging.getLogger("kvforge.kv.tiers")


class TierChain:
    def __init__(self, tiers: list[Tier], block_size: int):
        self.tiers = tiers
        self.block_size = block_size
        self.stats = [TierStats() for _ in tiers]
        self.pending: dict[BlockKey, bytes] = {}
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._warned: set[int] = set()
        self._worker = threading.Thread(target=self._run, name="kvforge-tier-store", daemon=True)
        self._worker.start()
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvforge-tier-load")

    # -- lookups and loads (the engine's thread) -----------------------------------------------

    def lookup(self, keys: list[BlockKey]) -> list[int | None]:
        """For each key, the index of the first tier holding it (-1: a store still queued), None: nowhere;
        tiers are asked only up to the first key no tier holds. A queued block counts as a hit of the first tier
        (it is on its way there)."""
        where: list[int | None] = [None] * len(keys)
        with self._lock:
            for i, k in enumerate(keys):
                if k in self.pending:
                    where[i] = -1
        queued = where.count(-1)
        if queued and self.tiers:
            self.stats[0].queried_blocks += queued
            self.stats[0].hit_blocks += queued
        for t, tier in enumerate(self.tiers):
            ask = [i for i, w in enumerate(where) if w is None]
            if not ask:
                break
            self.stats[t].queried_blocks += len(ask)
            found = self._call(t, tier.contains, [keys[i] for i in ask], default=[False] * len(ask), load=True)
            for i, hit in zip(ask, found):
                if hit:
                    where[i] = t
                    self.stats[t].hit_blocks += 1
        return where

    def leading_run(self, keys: list[BlockKey]) -> list[int]:
        """The tier of each of the leading keys that some tier holds (stops at the first miss)."""
        run = []
        for w in self.lookup(keys):
            if w is None:
                break
            run.append(w)
        return run

    def load(self, keys: list[BlockKey], where: list[int | None]) -> list[bytes | None]:
        """Payloads of keys found by `lookup` (None: unreadable). A key missing from its tier is looked for further
        down (the store worker may have pushed it there meanwhile); a failure counts against the tier it was in."""
        out: list[bytes | None] = [None] * len(keys)
        start = time.perf_counter()
        with self._lock:
            for i, k in enumerate(keys):
                out[i] = self.pending.get(k)
        queued = [p for p in out if p is not None]
        if queued and self.tiers:
            self.stats[0].loaded(len(queued), sum(len(p) for p in queued), time.perf_counter() - start)
        for t, tier in enumerate(self.tiers):
            # -1: queued at lookup time; the worker may have stored it since, so every tier is asked in turn
            ask = [i for i, w in enumerate(where) if w is not None and w <= t and out[i] is None]
            if not ask:
                continue
            start = time.perf_counter()
            got = self._call(t, tier.get, [keys[i] for i in ask], default=[None] * len(ask), load=None)
            seconds = time.perf_counter() - start
            for i, payload in zip(ask, got):
                out[i] = payload
            good = [p for p in got if p is not None]
            if good:
                self.stats[t].loaded(len(good), sum(len(p) for p in good), seconds)
        for i, w in enumerate(where):
            if out[i] is None and w is not None and w >= 0:
                self.stats[w].failed_loads += 1
        return out

    def fetch(self, keys: list[BlockKey], where: list[int]) -> Future:
        """`load` on the load worker thread: the engine keeps stepping other requests meanwhile."""
        return self._loader.submit(self.load, keys, where)

    # -- stores (queued; the worker writes) ----------------------------------------------------

    def store(self, items: list[tuple[BlockKey, bytes]]) -> None:
        if not items or not self.tiers:
            return
        with self._lock:
            for k, v in items:
                self.pending[k] = v
        self._queue.put(items)

    def discard(self, keys: list[BlockKey]) -> None:
        """Forget entries nobody will read again (a swap-in's private blocks), queued or stored."""
        with self._lock:
            for k in keys:
                self.pending.pop(k, None)
        for t, tier in enumerate(self.tiers):
            self._call(t, tier.discard, keys, default=None, load=False)

    def flush(self) -> None:
        """Wait until every queued store is written (tests, benchmarks, shutdown)."""
        self._queue.join()

    def close(self) -> None:
        self._loader.shutdown(wait=True)
        self.flush()
        self._queue.put(None)
        self._worker.join(timeout=10)
        for tier in self.tiers:
            try:
                tier.close()
            except Exception as e:  # noqa: BLE001 - closing a broken connection must not fail shutdown
                log.debug("closing KV tier %s: %s", tier.name, e)

    def _run(self) -> None:
        while True:
            items = self._queue.get()
            try:
                if items is None:
                    return
                with self._lock:
                    items = [(k, v) for k, v in items if self.pending.get(k) is v]  # not discarded meanwhile
                self._put_down(0, items)
            finally:
                if items is not None:
                    with self._lock:
                        for k, v in items:
                            if self.pending.get(k) is v:
                                del self.pending[k]
                self._queue.task_done()

    def _put_down(self, t: int, items: list[tuple[BlockKey, bytes]]) -> None:
        """Write items to tier t; what it pushes out goes on down. A pushed block stays in `pending` until the next
        tier has it, so lookups never miss a block in transit (a slow disk write, an fsync)."""
        moving: list[tuple[BlockKey, bytes]] = []
        while t < len(self.tiers) and items:
            start = time.perf_counter()
            pushed = self._call(t, self.tiers[t].put, items, default=None, load=False)
            seconds = time.perf_counter() - start
            self._forget_pending(moving)
            if pushed is None:
                return
            pushed_keys = {k for k, _ in pushed}
            kept = [(k, v) for k, v in items if k not in pushed_keys]
            self.stats[t].stored(len(kept), sum(len(v) for _, v in kept), seconds)
            self.stats[t].evicted_blocks += len(pushed) - (len(items) - len(kept))
            moving = [(k, v) for k, v in pushed if t + 1 < len(self.tiers)]
            with self._lock:
                for k, v in moving:
                    self.pending.setdefault(k, v)
            items, t = pushed, t + 1
        self._forget_pending(moving)

    def _forget_pending(self, items: list[tuple[BlockKey, bytes]]) -> None:
        with self._lock:
            for k, v in items:
                if self.pending.get(k) is v:
                    del self.pending[k]

    def _call(self, t: int, fn, arg, default, load: bool | None):
        """fn(arg), or `default` when the tier fails; the failure counts as failed loads (lookups), failed stores,
        or neither (load=None: `load` counts the blocks it could not read)."""
        try:
            return fn(arg)
        except Exception as e:  # noqa: BLE001 - a tier that fails is a miss; serving goes on
            if load:
                self.stats[t].failed_loads += len(arg)
            elif load is not None:
                self.stats[t].failed_stores += len(arg)
            if t not in self._warned:
                self._warned.add(t)
                log.warning("KV tier %s failed (%s: %s); its blocks count as misses until it works again",
                            self.tiers[t].name, type(e).__name__, e)
            return default

    # -- reporting ------------------------------------------------------------------------------

    def stats_dict(self) -> dict:
        out = {"kv_tiers": [t.name for t in self.tiers]}
        for tier, st in zip(self.tiers, self.stats):
            try:
                used = tier.used_bytes()
            except Exception:  # noqa: BLE001 - a store that is down reports nothing used
                used = 0
            out.update(st.as_dict(f"tier_{tier.name}", self.block_size, used))
        return out
