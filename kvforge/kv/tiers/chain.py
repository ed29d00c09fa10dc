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
    """`write_through[t]`: tier t gets every block when it is cached (`store_through`); the other tiers form the
    write-back chain: `store` writes the first of them, and what one pushes out goes to the next of them."""

    def __init__(self, tiers: list[Tier], block_size: int, write_through: list[bool] | None = None):
        self.tiers = tiers
        self.block_size = block_size
        self.write_through = write_through or [False] * len(tiers)
        self.through_tiers = [t for t, w in enumerate(self.write_through) if w]
        self.back_tiers = [t for t, w in enumerate(self.write_through) if not w]
        self.stats = [TierStats() for _ in tiers]
        self.pending: dict[BlockKey, bytes] = {}
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._warned: set[int] = set()
        self.closed = False
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
        """Write-back: items go to the first write-back tier (tier 0 when every tier is write-through: a swap)."""
        self.store_to(items, self.back_tiers[:1] or [0], push=True)

    def store_through(self, items: list[tuple[BlockKey, bytes]]) -> None:
        """Write-through: items go to every write-through tier."""
        self.store_to(items, self.through_tiers, push=False)

    def store_to(self, items: list[tuple[BlockKey, bytes]], targets: list[int], push: bool) -> None:
        """Queue items for each tier in targets; with `push`, what a tier pushes out goes on down the write-back
        chain (without, it is dropped: the tiers below got those blocks when they were cached)."""
        if not items or not self.tiers or not targets:
            return
        with self._lock:
            for k, v in items:
                self.pending[k] = v
        self._queue.put((items, targets, push))

    def discard(self, keys: list[BlockKey]) -> None:
        """Forget entries nobody will read again (a swap-in's private blocks), queued or stored."""
        with self._lock:
            for k in keys:
                self.pending.pop(k, None)
        for t, tier in enumerate(self.tiers):
            self._call(t, tier.discard, keys, default=None, load=False)

    def flush(self, timeout: float | None = None) -> int:
        """Wait until every queued store is written, or `timeout` seconds; returns the blocks not yet written."""
        deadline = None if timeout is None else time.monotonic() + timeout
        done = self._queue.all_tasks_done
        with done:
            while self._queue.unfinished_tasks:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                done.wait(left)
        with self._lock:
            return len(self.pending)

    def close(self, timeout: float | None = None) -> int:
        """Write what is queued (for at most `timeout` seconds), then stop; returns the blocks left unwritten."""
        self.closed = True
        self._loader.shutdown(wait=True)
        left = self.flush(timeout)
        self._queue.put(None)
        self._worker.join(timeout=10 if left == 0 else 0.1)
        for tier in self.tiers:
            try:
                tier.close()
            except Exception as e:  # noqa: BLE001 - closing a broken connection must not fail shutdown
                log.debug("closing KV tier %s: %s", tier.name, e)
        return left

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            items = None if job is None else job[0]
            try:
                if job is None:
                    return
                with self._lock:
                    items = [(k, v) for k, v in items if self.pending.get(k) is v]  # not discarded meanwhile
                for t in job[1]:
                    self._put_down(t, items, job[2])
            finally:
                if items is not None:
                    with self._lock:
                        for k, v in items:
                            if self.pending.get(k) is v:
                                del self.pending[k]
                self._queue.task_done()

    def _put_down(self, t: int | None, items: list[tuple[BlockKey, bytes]], push: bool) -> None:
        """Write items to tier t; with `push`, what it pushes out goes on down the write-back chain. A pushed block
        stays in `pending` until the next tier has it, so lookups never miss a block in transit (a slow disk
        write, an fsync)."""
        moving: list[tuple[BlockKey, bytes]] = []
        while t is not None and items:
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
            below = self._next_back(t) if push else None
            moving = [(k, v) for k, v in pushed if below is not None]
            with self._lock:
                for k, v in moving:
                    self.pending.setdefault(k, v)
            items, t = pushed, below
        self._forget_pending(moving)

    def _next_back(self, t: int) -> int | None:
        return next((b for b in self.back_tiers if b > t), None)

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
