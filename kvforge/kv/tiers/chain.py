"""TierChain: the ordered tiers below the pool, and the worker threads that do their I/O off the step loop.

Stores are queued (a bounded queue: when the worker falls behind, new stores are dropped and counted); until
the worker has written a block it stays in `pending`, where lookups and loads find it, so a queued store is never
a miss and a failed one is never visible. Discards go through the same queue, so a key is discarded only after
any store of it queued or in flight. A tier that fills pushes its least recently used entries down to the next
tier (the last one drops them). Lookups of tiers that may hang (Redis) and all loads run on the load worker.
Any tier error is counted, logged, and read as a miss; a tier that keeps failing is skipped for a back-off
period (kvforge.kv.tiers.breaker), then probed again.
"""
from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from kvforge.kv.tiers.base import Tier
from kvforge.kv.tiers.breaker import CircuitBreaker
from kvforge.kv.tiers.keys import BlockKey
from kvforge.kv.tiers.stats import TierStats

log = logging.getLogger("kvforge.kv.tiers")
MAX_QUEUED_BYTES = 256 << 20  # stores waiting for the worker; past it new stores are dropped (counted)


class TierChain:
    """`write_through[t]`: tier t gets every block when it is cached (`store_through`); the other tiers form the
    write-back chain: `store` writes the first of them, and what one pushes out goes to the next of them."""

    def __init__(self, tiers: list[Tier], block_size: int, write_through: list[bool] | None = None,
                 max_queued_bytes: int = MAX_QUEUED_BYTES, breakers: list[CircuitBreaker] | None = None):
        self.tiers = tiers
        self.block_size = block_size
        self.write_through = write_through or [False] * len(tiers)
        self.through_tiers = [t for t, w in enumerate(self.write_through) if w]
        self.back_tiers = [t for t, w in enumerate(self.write_through) if not w]
        self.stats = [TierStats() for _ in tiers]
        self.breakers = breakers or [CircuitBreaker() for _ in tiers]
        self.pending: dict[BlockKey, bytes] = {}
        self.private: set[BlockKey] = set()  # swap keys stored and not yet discarded
        self.max_queued_bytes = max_queued_bytes
        self.queued_bytes = 0
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()  # ("store" | "discard", items or keys, bytes); None: stop
        self._reading: dict[int, float] = {}  # tier -> when the lookup or load in flight on it began
        self.closed = False
        self._worker = threading.Thread(target=self._run, name="kvforge-tier-store", daemon=True)
        self._worker.start()
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvforge-tier-load")

    # -- lookups and loads -----------------------------------------------------------------------

    def lookup_may_hang(self) -> bool:
        """Whether a lookup now would call a remote tier (one whose breaker lets calls through): then it must run
        on the load worker (`fetch_run`), else the engine thread may look up itself (`leading_run(local=True)`).
        While a lookup or load of a remote tier has been in flight for `slow_call_s`, new requests do not queue
        behind it: they look up locally (the remote tier's keys count as skipped)."""
        return any(t.remote and b.would_allow() and not self._stuck(i, b)
                   for i, (t, b) in enumerate(zip(self.tiers, self.breakers)))

    def _stuck(self, t: int, breaker: CircuitBreaker) -> bool:
        began = self._reading.get(t)
        return began is not None and breaker.clock() - began >= breaker.slow_call_s

    def lookup(self, keys: list[BlockKey], local: bool = False) -> list[int | None]:
        """For each key, the index of the first tier holding it (-1: a store still queued), None: nowhere;
        tiers are asked only up to the first key no tier holds. A queued block counts as a hit of the first tier
        (it is on its way there). `local`: remote tiers are not called (their keys count as skipped)."""
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
            if local and tier.remote:
                self.stats[t].skipped_blocks += len(ask)
                continue
            found = self.call(t, tier.contains, [keys[i] for i in ask], default=[False] * len(ask), load=True)
            for i, hit in zip(ask, found):
                if hit:
                    where[i] = t
                    self.stats[t].hit_blocks += 1
        return where

    def leading_run(self, keys: list[BlockKey], local: bool = False) -> list[int]:
        """The tier of each of the leading keys that some tier holds (stops at the first miss)."""
        run = []
        for w in self.lookup(keys, local):
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
            got = self.call(t, tier.get, [keys[i] for i in ask], default=[None] * len(ask), load=None)
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

    def holder(self, key: BlockKey, local: bool = False) -> int | None:
        """The first tier holding `key` (-1: a store still queued), None: none; `local`: remote tiers are not called.
        Not counted in the tiers' block lookups (a state checkpoint's, kvforge.kv.tiers.state_tiers)."""
        with self._lock:
            if key in self.pending:
                return -1
        for t, tier in enumerate(self.tiers):
            if not (local and tier.remote) and self.call(t, tier.contains, [key], default=[False], load=True)[0]:
                return t
        return None

    def deepest(self, keys: list[BlockKey], local: bool = False) -> tuple[int, int] | None:
        """(index, tier) of the last of `keys` that some tier holds (tier -1: a store still queued), None: none;
        `local`: remote tiers are not called. Not counted in the tiers' block lookups (as `holder`). A remote tier is
        asked once for all; a local one key by key from the last (a disk tier finds another process's files only
        as a leading run of what it is asked)."""
        with self._lock:
            queued = [i for i, k in enumerate(keys) if k in self.pending]
        best = (queued[-1], -1) if queued else None
        for t, tier in enumerate(self.tiers):
            first = best[0] + 1 if best is not None else 0
            if first >= len(keys) or (local and tier.remote):
                continue
            if tier.remote:
                found = self.call(t, tier.contains, keys[first:], default=[False] * (len(keys) - first), load=True)
                hits = [first + i for i, hit in enumerate(found) if hit]
            else:
                hits = next(([i] for i in range(len(keys) - 1, first - 1, -1)
                             if self.call(t, tier.contains, [keys[i]], default=[False], load=True)[0]), [])
            if hits:
                best = (hits[-1], t)
        return best

    def submit(self, fn) -> Future:
        """Run fn() on the load worker."""
        return self._loader.submit(fn)

    def fetch(self, keys: list[BlockKey], where: list[int]) -> Future:
        """`load` on the load worker thread: the engine keeps stepping other requests meanwhile."""
        return self._loader.submit(self.load, keys, where)

    def fetch_run(self, keys: list[BlockKey]) -> Future:
        """Look up and load the leading run of keys that some tier holds, all on the load worker."""
        def run() -> list[bytes | None]:
            where = self.leading_run(keys)
            return self.load(keys[:len(where)], where)
        return self._loader.submit(run)

    def fetch_all(self, keys: list[BlockKey]) -> Future:
        """Look up and load every key on the load worker (None for one no tier holds)."""
        return self._loader.submit(lambda: self.load(keys, self.lookup(keys)))

    # -- stores and discards (queued; the store worker runs them in order) ----------------------

    def store(self, items: list[tuple[BlockKey, bytes]], private: bool = False) -> bool:
        """Write-back: items go to the first write-back tier (tier 0 when every tier is write-through: a swap).
        `private`: a swapped request's blocks, discarded after their one read."""
        return self.store_to(items, self.back_tiers[:1] or [0], push=True, private=private)

    def store_through(self, items: list[tuple[BlockKey, bytes]]) -> bool:
        """Write-through: items go to every write-through tier."""
        return self.store_to(items, self.through_tiers, push=False)

    def store_to(self, items: list[tuple[BlockKey, bytes]], targets: list[int], push: bool,
                 private: bool = False) -> bool:
        """Queue items for the store worker to write to each tier in targets; with `push`, what a tier pushes out goes
        on down the write-back chain (without, it is dropped: the tiers below got those blocks when they were
        cached). False (and counted as dropped) when the queue is full."""
        if not items or not self.tiers or not targets:
            return True
        nbytes = sum(len(v) for _, v in items)
        with self._lock:
            if self.queued_bytes and self.queued_bytes + nbytes > self.max_queued_bytes:
                self.stats[0].dropped_stores += len(items)
                return False
            self.queued_bytes += nbytes
            for k, v in items:
                self.pending[k] = v
            if private:
                self.private.update(k for k, _ in items)
        self._queue.put(("store", items, nbytes, targets, push))
        return True

    def discard(self, keys: list[BlockKey]) -> None:
        """Forget entries nobody will read again (a swap-in's private blocks): at once from `pending`, and from the
        tiers after every store of them already queued or in flight (the worker runs both in order)."""
        if not keys or not self.tiers:
            return
        with self._lock:
            for k in keys:
                self.pending.pop(k, None)
                self.private.discard(k)
        self._queue.put(("discard", keys, 0, None, False))

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
            try:
                if job is None:
                    return
                kind, items, nbytes, targets, push = job
                if kind == "discard":
                    for t, tier in enumerate(self.tiers):
                        self.call(t, tier.discard, items, default=None, load=False)
                    continue
                with self._lock:
                    items = [(k, v) for k, v in items if self.pending.get(k) is v]  # not discarded meanwhile
                try:
                    for t in targets:
                        self._put_down(t, items, push)
                finally:
                    self._forget_pending(items)
                    with self._lock:
                        self.queued_bytes -= nbytes
            finally:
                self._queue.task_done()

    def _put_down(self, t: int | None, items: list[tuple[BlockKey, bytes]], push: bool) -> None:
        """Write items to tier t; with `push`, what it pushes out goes on down the write-back chain. A pushed block
        stays in `pending` until the next tier has it, so lookups never miss a block in transit (a slow disk
        write, an fsync)."""
        moving: list[tuple[BlockKey, bytes]] = []
        while t is not None and items:
            start = time.perf_counter()
            with self._lock:
                private = frozenset(k for k, _ in items if k in self.private)
            put = functools.partial(self.tiers[t].put, private=private)
            pushed = self.call(t, put, items, default=None, load=False)
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

    def call(self, t: int, fn, arg, default, load: bool | None):
        """fn(arg), or `default` when the tier fails or its breaker is open (the call is then skipped and its blocks
        counted as skipped); a failure counts as failed loads (lookups), failed stores, or neither (load=None:
        `load` counts the blocks it could not read)."""
        breaker = self.breakers[t]
        if not breaker.allow():
            self.stats[t].skipped_blocks += len(arg)
            return default
        began, reading = breaker.clock(), load is not False and self.tiers[t].remote
        if reading:
            self._reading[t] = began
        try:
            out = fn(arg)
        except Exception as e:  # noqa: BLE001 - a tier that fails is a miss; serving goes on
            if load:
                self.stats[t].failed_loads += len(arg)
            elif load is not None:
                self.stats[t].failed_stores += len(arg)
            trips = breaker.trips
            breaker.failed(breaker.clock() - began)
            if breaker.trips > trips:
                log.warning("KV tier %s failed %d times in a row (last: %s: %s); skipped for %.1f s, then retried",
                            self.tiers[t].name, breaker.failures, type(e).__name__, e,
                            (breaker.open_until or 0.0) - breaker.clock())
            return default
        finally:
            if reading:
                self._reading.pop(t, None)
        if breaker.is_open:
            log.warning("KV tier %s works again", self.tiers[t].name)
        breaker.succeeded()
        return out

    # -- reporting ------------------------------------------------------------------------------

    def stats_dict(self) -> dict:
        out = {"kv_tiers": [t.name for t in self.tiers]}
        for tier, st, breaker in zip(self.tiers, self.stats, self.breakers):
            try:
                used = tier.used_bytes()
            except Exception:  # noqa: BLE001 - a store that is down reports nothing used
                used = 0
            out.update(st.as_dict(f"tier_{tier.name}", self.block_size, used))
            out[f"tier_{tier.name}_circuit_open"] = int(breaker.is_open)
            out[f"tier_{tier.name}_circuit_trips"] = breaker.trips
        return out
