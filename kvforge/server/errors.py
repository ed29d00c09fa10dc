"""Errors in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}}."""
from __future__ import annotations

import logging

from fastapi.responses import JSONResponse

log = logging.getLogger("kvforge.server")


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unauthorized() -> APIError:
    return APIError(401, "invalid or missing API key; send 'Authorization: Bearer <key>'", "authentication_error",
                    code="invalid_api_key")


def model_not_found(name: str, served: list[str]) -> APIError:
    return APIError(404, f"model {name!r} does not exist; this server serves {served}", param="model",
                    code="model_not_found")


def queue_full(max_waiting: int) -> APIError:
    return APIError(429, f"the server's waiting queue is full ({max_waiting} requests); retry later", "rate_limit_error",
                    code="rate_limit_exceeded")


def server_error(message: str) -> APIError:
    return APIError(500, message, "server_error", code="internal_error")


def engine_unavailable(reason: str) -> APIError:
    return APIError(503, f"{reason}; the server cannot run requests (restart it)", "server_error",
                    code="engine_unavailable")


class InternalErrors:
    """ASGI middleware: an unexpected exception becomes an OpenAI-shaped 500 and goes no further. (Starlette's own
    handler for Exception re-raises after answering, and uvicorn then closes the keep-alive connection under the
    client's next request.) Once a response has started, the status is sent: the exception goes on."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def send_noting_start(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_noting_start)
        except Exception as e:
            log.exception("%s %s failed", scope.get("method"), scope.get("path"))
            if started:
                raise
            await server_error(f"internal error: {type(e).__name__}: {e}").response()(scope, receive, send)
