"""EngineLoop: one thread owns the (not thread-safe) LLMEngine; handlers talk to it through commands.

No request waits forever:
- a step that fails a batch finishes those requests with finish_reason 'error' (the engine keeps serving);
- whatever else escapes the loop (a command handler, the error path of a step that raised) kills the loop
  loudly: every waiter gets a 503, `alive` turns False (/health), `on_death` runs (the CLI exits non-zero),
  and every later call fails at once;
- `stop()` fails the queued commands; a thread that does not join is kept, and its open requests fail at once.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvforge.engine.engine import LLMEngine
from kvforge.sampling_params import SamplingParams
from kvforge.server.errors import APIError, engine_unavailable, queue_full, server_error
from kvforge.server.mailbox import Mailbox
from kvforge.server.metrics import ServerMetrics

log = logging.getLogger("kvforge.server")


@dataclass
class Submission:
    prompt: list[int]
    params: SamplingParams
    cache_salt: str | None = None


@dataclass
class _Stream:
    mailbox: Mailbox
    index: int
    last_token_time: float | None = None


@dataclass
class RequestGroup:
    """The engine requests behind one HTTP request; their outputs arrive in `mailbox` by index."""
    ids: list[str]
    mailbox: Mailbox


class EngineLoop:
    def __init__(self, engine: LLMEngine, max_waiting: int | None = None,
                 on_death: Callable[[BaseException], None] | None = None):
        self.engine = engine
        self.max_waiting = max_waiting
        self.on_death = on_death
        self.metrics = ServerMetrics()
        self.error: BaseException | None = None  # why the loop died
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # touched by the loop thread only
        self._mailboxes: weakref.WeakSet[Mailbox] = weakref.WeakSet()
        self._ids = itertools.count()
        self._lock = threading.Lock()  # guards _closed, the counters below and _mailboxes
        self._closed = False  # no command is accepted once set
        self._pending_adds = 0
        self._num_waiting = 0
        self._thread: threading.Thread | None = None
        self._running = False

    # -- called from request handlers (any thread / event loop) -----------------------------------

    def start(self) -> None:
        if self._closed:
            raise RuntimeError("this engine loop was stopped or died; build a new app to serve again")
        if self._thread is None:
            self._running = True
            self._thread = threading.Thread(target=self._run, name="kvforge-engine-loop", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 30) -> bool:
        """Stop the loop; False when its thread did not end within timeout (it is kept: no second loop can start)."""
        thread = self._thread
        if thread is None:
            return True
        self._running = False
        self._commands.put(("wake",))
        thread.join(timeout=timeout)
        self._close()
        failure = engine_unavailable("the server is shutting down")
        self._fail_queued(failure)
        if thread.is_alive():
            log.error("the engine loop thread did not stop within %.0f s; it still holds the engine", timeout)
            with self._lock:
                waiting = list(self._mailboxes)
            for mailbox in waiting:  # their handlers must not wait for a thread that may never come back
                mailbox.fail(failure)
            return False
        self._thread = None
        return True

    @property
    def stopped(self) -> bool:
        """No loop thread holds the engine (never started, stopped, or died): the caller may close it."""
        return self._thread is None or not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None and not self._closed

    async def submit(self, subs: list[Submission]) -> RequestGroup:
        """Add all of subs to the engine (all or none); raises the engine's InvalidRequestError or an APIError."""
        with self._lock:
            if self.max_waiting is not None and self._num_waiting + self._pending_adds + len(subs) > self.max_waiting:
                self.metrics.observe_rejected()
                raise queue_full(self.max_waiting)
            self._pending_adds += len(subs)
        base = f"req-{next(self._ids)}"
        ids = [f"{base}-{i}" for i in range(len(subs))]
        mailbox = Mailbox(asyncio.get_running_loop())
        with self._lock:
            self._mailboxes.add(mailbox)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        try:
            self._send(("add", ids, subs, mailbox, fut))
        except APIError:
            with self._lock:
                self._pending_adds -= len(subs)
            raise
        try:
            await asyncio.wrap_future(fut)
        except asyncio.CancelledError:  # the client left while its requests were being added
            self.abort(ids)
            raise
        return RequestGroup(ids, mailbox)

    def abort(self, ids: list[str]) -> None:
        try:
            self._send(("abort", list(ids)))
        except APIError:
            pass  # the loop is gone, and its requests with it

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run fn(engine) on the loop thread between steps (stats, reset_prefix_cache, ...)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._send(("call", fn, fut))
        return await asyncio.wrap_future(fut)

    def held_outputs(self) -> tuple[int, int]:
        """(outputs, token ids) delivered but not yet read by their handlers, over all live requests."""
        with self._lock:
            held = [m.held() for m in self._mailboxes]
        return sum(h[0] for h in held), sum(h[1] for h in held)

    def _send(self, command: tuple) -> None:
        with self._lock:
            if self._closed:
                raise self._unavailable()
            self._commands.put(command)

    def _unavailable(self) -> APIError:
        if self.error is not None:
            return engine_unavailable(f"the engine loop died: {type(self.error).__name__}: {self.error}")
        return engine_unavailable("the server is shutting down")

    # -- the loop thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._running:
                busy = self.engine.has_unfinished_requests()
                try:
                    command = self._commands.get_nowait() if busy else self._commands.get()
                except queue.Empty:
                    command = None
                while command is not None:
                    self._handle(command)
                    try:
                        command = self._commands.get_nowait()
                    except queue.Empty:
                        command = None
                if self._running and self.engine.has_unfinished_requests():
                    self._step()
                self._publish_waiting()
        except BaseException as e:  # the loop dies loudly: every waiter is told below
            self.error = e
            log.critical("the engine loop died; failing every request", exc_info=e)
            if self.on_death is not None:
                try:
                    self.on_death(e)
                except Exception:
                    log.exception("on_death failed")
        self._shut_down()

    def _shut_down(self) -> None:
        """Refuse new commands, then fail every waiter: queued commands and open streams."""
        self._close()
        failure = self._unavailable()
        self._fail_queued(failure)
        for rid, stream in list(self._streams.items()):
            stream.mailbox.put(stream.index, failure)
            try:
                self.engine.abort(rid)
            except Exception:  # best effort: the engine may be what broke
                log.exception("could not abort %s while shutting down", rid)
        self._streams.clear()

    def _close(self) -> None:
        with self._lock:
            self._closed = True

    def _fail_queued(self, failure: APIError) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                with self._lock:
                    self._pending_adds -= len(command[2])
            fut = command[-1] if command[0] in ("add", "call") else None
            if fut is not None and not fut.done():
                fut.set_exception(failure)

    def _publish_waiting(self) -> None:
        with self._lock:
            self._num_waiting = len(self.engine.scheduler.waiting)

    def _handle(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            self._add(*command[1:])
        elif kind == "abort":
            for rid in command[1]:
                seq = self.engine.requests.get(rid)
                if seq is not None and self.engine.abort(rid):
                    self.metrics.observe_finish("abort", len(seq.prompt_token_ids), None)
                self._streams.pop(rid, None)
        elif kind == "call":
            fn, fut = command[1], command[2]
            try:
                fut.set_result(fn(self.engine))
            except Exception as e:  # noqa: BLE001 - reported to the caller
                fut.set_exception(e)

    def _add(self, ids: list[str], subs: list[Submission], mailbox: Mailbox, fut: concurrent.futures.Future) -> None:
        added: list[str] = []
        try:
            for index, (rid, sub) in enumerate(zip(ids, subs)):
                self.engine.add_request(sub.prompt, sub.params, rid, sub.cache_salt)
                added.append(rid)
                self._streams[rid] = _Stream(mailbox, index)
        except Exception as e:  # noqa: BLE001 - reported to the caller
            for rid in added:
                self._streams.pop(rid, None)
                self.engine.abort(rid)
            fut.set_exception(e)
        else:
            fut.set_result(None)
        finally:
            with self._lock:
                self._num_waiting = len(self.engine.scheduler.waiting)
                self._pending_adds -= len(subs)

    def _step(self) -> None:
        start = time.monotonic()
        try:
            outputs = self.engine.step()
            self.metrics.observe_step(time.monotonic() - start)
        except Exception as e:  # the engine's own state is in doubt: fail what it holds
            log.exception("engine step raised; failing its %d requests", len(self.engine.requests))
            failure = server_error(f"the engine failed while running this request: {type(e).__name__}: {e}")
            for rid in list(self.engine.requests):
                self.engine.abort(rid)
                stream = self._streams.pop(rid, None)
                if stream is not None:
                    stream.mailbox.put(stream.index, failure)
                    self.metrics.observe_finish("error", 0, None)
            return
        now = time.monotonic()
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finish_reason == "error":
                del self._streams[out.request_id]
                self.metrics.observe_finish("error", len(out.prompt_token_ids), None)
                stream.mailbox.put(stream.index, server_error(f"the engine failed while running this request: {out.error}"))
                continue
            first = stream.last_token_time is None
            self.metrics.observe_token(out.metrics.ttft if first else None,
                                       None if first else now - stream.last_token_time)
            stream.last_token_time = now
            if out.finished:
                del self._streams[out.request_id]
                e2e = out.metrics.finished_time - out.metrics.arrival_time if out.metrics.finished_time else None
                self.metrics.observe_finish(out.finish_reason, len(out.prompt_token_ids), e2e)
            stream.mailbox.put(stream.index, out)
