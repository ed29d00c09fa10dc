"""The HTTP entry of the deployment: forwards every request to a replica chosen by the router.

The body is read once, within the server's body limit (a 413 past it), to find the routing key (the prompt), then
method, path, headers and body go to the replica's app unchanged, and its response streams back. A request the app
refuses (4xx/5xx) is forgotten by the routers: its chunks do not count as held by that replica. A replica that dies
mid-request ends the request with an error: a 503 before the response started, an error event in the stream after.
"""
# no `from __future__ import annotations`: FastAPI must see real classes after serve.ingress rewrites the methods

import json

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from ray import serve

from kvforge.serve_ray import metrics
from kvforge.serve_ray.prefix_keys import chunk_hashes, routing_key
from kvforge.serve_ray.replica import REPLICA_HEADER
from kvforge.server.errors import APIError
from kvforge.server.limits import RequestLimits

app = FastAPI(title="kvforge on Ray Serve")


async def _rest(stream, sse: bool):
    try:
        async for chunk in stream:
            yield chunk
    except Exception as e:
        if sse:
            body = replica_failed(e).body()
            yield f"data: {json.dumps(body)}\n\n".encode()
        else:
            raise


def _is_sse(head: list[tuple[str, str]]) -> bool:
    return any(k.lower() == "content-type" and v.startswith("text/event-stream") for k, v in head)


def replica_failed(e: Exception) -> APIError:
    reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    return APIError(503, f"the replica serving this request failed ({reason}); retry it: Ray Serve routes it to a "
                    "live replica and replaces the failed one", "server_error", code="replica_unavailable")


@serve.ingress(app)  # at import, so the replica that imports this module gets the same routes
class KVForgeIngress:
    def __init__(self, replicas, max_body_bytes: int = RequestLimits.max_body_bytes):
        self.replicas = replicas  # a DeploymentHandle of KVForgeReplica
        self.limits = RequestLimits(max_body_bytes=max_body_bytes)  # the replicas' own body limit

    @app.get("/metrics")
    async def metrics(self) -> PlainTextResponse:
        from kvforge.serve_ray import registry  # the process's one copy (Ray may ship this class by value)

        texts = {rid: s["metrics"] for r in list(registry.ROUTERS) for rid, s in r.replica_stats().items()
                 if s.get("metrics")}
        text = metrics.merge(texts, registry.ROUTER_CHOICES)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE"])
    async def forward(self, request: Request) -> Response:
        try:
            body = await self.limits.read_body(request)
        except APIError as e:
            return e.response()
        path = request.url.path
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in ("host", "content-length")]
        headers.append(("content-length", str(len(body))))
        key = routing_key(path, body)
        stream = self.replicas.options(stream=True).handle.remote(request.method, path, request.url.query, headers,
                                                                  body, key)
        try:
            status, head = await stream.__anext__()
        except Exception as e:  # noqa: BLE001 - the replica died or could not be reached
            stream.cancel()
            return replica_failed(e).response()
        if status >= 400 and key:
            from kvforge.serve_ray import registry  # the process's one copy

            registry.forget(dict(head).get(REPLICA_HEADER, ""), chunk_hashes(key))
        return StreamingResponse(_rest(stream, _is_sse(head)), status_code=status, headers=dict(head))
