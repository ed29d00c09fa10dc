"""Call an ASGI app in-process and hand back its response as a stream: (status, headers) first, then body chunks.

A replica serves requests with the same FastAPI app as `kvforge serve`, without a socket: the ingress forwards
the method, path, headers and body, and streams back what the app sends. Closing the stream tells the app that
its client went away, so streaming requests are aborted in the engine as they are behind uvicorn.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

Head = tuple[int, list[tuple[str, str]]]


async def call_asgi(app, method: str, path: str, query: str, headers: list[tuple[str, str]],
                    body: bytes) -> AsyncIterator[Head | bytes]:
    messages: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    delivered = False

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def run() -> None:
        try:
            await app(scope, receive, messages.put)
        finally:
            messages.put_nowait(None)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": query.encode(), "root_path": "",
             "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers],
             "server": ("kvforge-replica", 80), "client": ("ray-serve", 0)}
    task = asyncio.create_task(run())
    try:
        while (message := await messages.get()) is not None:
            if message["type"] == "http.response.start":
                yield message["status"], [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message["headers"]]
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    break
        await task
    finally:
        gone.set()
        if not task.done():
            try:
                await asyncio.wait_for(task, timeout=5)
            except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - the client is gone; nothing to tell
                task.cancel()
