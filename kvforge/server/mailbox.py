"""Mailbox: the engine loop thread hands outputs to one HTTP request's handler, coalesced per engine request."""
from __future__ import annotations

import asyncio
import dataclasses
import threading

from kvforge.outputs import RequestOutput

Item = RequestOutput | Exception


class Mailbox:
    """Holds at most one undelivered item per engine request, so a reader that falls behind (a slow client, a
    stalled socket) costs O(choices) items however many steps run meanwhile. A newer output replaces the waiting
    one and carries the new token ids of both; an exception is final. The bytes held per request are bounded by
    its output (max_tokens), which the engine keeps anyway until the request ends."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._items: dict[int, Item] = {}
        self._ready = asyncio.Event()

    def put(self, index: int, item: Item) -> None:
        """Called from any thread."""
        with self._lock:
            prev = self._items.get(index)
            if isinstance(prev, Exception):
                return
            if isinstance(prev, RequestOutput) and isinstance(item, RequestOutput):
                item = dataclasses.replace(item, new_token_ids=prev.new_token_ids + item.new_token_ids)
            self._items[index] = item
        try:
            self._loop.call_soon_threadsafe(self._ready.set)
        except RuntimeError:  # the handler's event loop is closed: nobody is listening
            pass

    def fail(self, error: Exception) -> None:
        """End the whole HTTP request with error (from any thread), whatever its engine requests are doing."""
        self.put(-1, error)

    async def get(self) -> list[tuple[int, Item]]:
        """Every waiting item, by request index; waits until there is one. Called on the handler's event loop."""
        while True:
            with self._lock:
                if self._items:
                    items = sorted(self._items.items(), key=lambda kv: kv[0])
                    self._items.clear()
                    return items
                self._ready.clear()
            await self._ready.wait()

    def held(self) -> tuple[int, int]:
        """(items, token ids) waiting to be read."""
        with self._lock:
            tokens = sum(len(i.new_token_ids) for i in self._items.values() if isinstance(i, RequestOutput))
            return len(self._items), tokens
