"""EngineLoop: one thread owns the (not thread-safe) LLMEngine; handlers talk to it through queues."""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvforge.engine.engine import LLMEngine
from kvforge.outputs import RequestOutput
from kvforge.sampling_params import SamplingParams
from kvforge.server.errors import queue_full
from kvforge.server.metrics import ServerMetrics

log = logging.getLogger("kvforge.server")


@dataclass
class Submission:
    prompt: list[int]
    params: SamplingParams
    cache_salt: str | None = None


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    index: int
    last_token_time: float | None = None


@dataclass
class RequestGroup:
    """The engine requests behind one HTTP request; outputs arrive on `queue` as (index, RequestOutput | Exception)."""
    ids: list[str]
    queue: asyncio.Queue


class EngineLoop:
    def __init__(self, engine: LLMEngine, max_waiting: int | None = None):
        self.engine = engine
        self.max_waiting = max_waiting
        self.metrics = ServerMetrics()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # touched by the loop thread only
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._pending_adds = 0
        self._num_waiting = 0  # published by the loop thread after each step
        self._thread: threading.Thread | None = None
        self._running = False

    # -- called from request handlers (any thread / event loop) -----------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._running = True
            self._thread = threading.Thread(target=self._run, name="kvforge-engine-loop", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._running = False
            self._commands.put(("wake",))
            self._thread.join(timeout=30)
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def submit(self, subs: list[Submission]) -> RequestGroup:
        """Add all of subs to the engine (all or none); raises the engine's InvalidRequestError or a 429 APIError."""
        with self._lock:
            if self.max_waiting is not None and self._num_waiting + self._pending_adds + len(subs) > self.max_waiting:
                self.metrics.observe_rejected()
                raise queue_full(self.max_waiting)
            self._pending_adds += len(subs)
        base = f"req-{next(self._ids)}"
        ids = [f"{base}-{i}" for i in range(len(subs))]
        q: asyncio.Queue = asyncio.Queue()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("add", ids, subs, asyncio.get_running_loop(), q, fut))
        await asyncio.wrap_future(fut)
        return RequestGroup(ids, q)

    def abort(self, ids: list[str]) -> None:
        self._commands.put(("abort", list(ids)))

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run fn(engine) on the loop thread between steps (stats, reset_prefix_cache, ...)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("call", fn, fut))
        return await asyncio.wrap_future(fut)

    # -- the loop thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        while self._running:
            try:
                busy = self.engine.has_unfinished_requests()
                command = self._commands.get_nowait() if busy else self._commands.get()
            except queue.Empty:
                command = None
            while command is not None:
                self._handle(command)
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
            if self.engine.has_unfinished_requests():
                self._step()
            self._num_waiting = len(self.engine.scheduler.waiting)

    def _handle(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            self._add(*command[1:])
        elif kind == "abort":
            for rid in command[1]:
                self._streams.pop(rid, None)
                seq = self.engine.requests.get(rid)
                if seq is not None and self.engine.abort(rid):
                    self.metrics.observe_finish("abort", len(seq.prompt_token_ids), None)
        elif kind == "call":
            fn, fut = command[1], command[2]
            try:
                fut.set_result(fn(self.engine))
            except Exception as e:  # noqa: BLE001 - reported to the caller
                fut.set_exception(e)

    def _add(self, ids: list[str], subs: list[Submission], loop: asyncio.AbstractEventLoop, q: asyncio.Queue,
             fut: concurrent.futures.Future) -> None:
        added: list[str] = []
        try:
            for index, (rid, sub) in enumerate(zip(ids, subs)):
                self.engine.add_request(sub.prompt, sub.params, rid, sub.cache_salt)
                added.append(rid)
                self._streams[rid] = _Stream(loop, q, index)
        except Exception as e:  # noqa: BLE001 - reported to the caller
            for rid in added:
                self._streams.pop(rid, None)
                self.engine.abort(rid)
            fut.set_exception(e)
        else:
            fut.set_result(None)
        finally:
            self._num_waiting = len(self.engine.scheduler.waiting)
            with self._lock:
                self._pending_adds -= len(subs)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            log.exception("engine step failed; aborting %d requests", len(self._streams))
            for rid, stream in list(self._streams.items()):
                self.engine.abort(rid)
                _deliver(stream, e)
            self._streams.clear()
            return
        now = time.monotonic()
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            first = stream.last_token_time is None
            self.metrics.observe_token(out.metrics.ttft if first else None,
                                       None if first else now - stream.last_token_time)
            stream.last_token_time = now
            if out.finished:
                del self._streams[out.request_id]
                e2e = out.metrics.finished_time - out.metrics.arrival_time if out.metrics.finished_time else None
                self.metrics.observe_finish(out.finish_reason, len(out.prompt_token_ids), e2e)
            _deliver(stream, out)


def _deliver(stream: _Stream, item: RequestOutput | Exception) -> None:
    try:
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, (stream.index, item))
    except RuntimeError:  # the handler's event loop is closed: nobody is listening
        pass
