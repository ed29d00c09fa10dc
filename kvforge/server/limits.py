"""RequestLimits: how much one request may ask of the server; each bound is refused with a 400 naming it (a body
past max_body_bytes with a 413)."""
from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from kvforge.sampling_params import MAX_LOGPROBS
from kvforge.server.errors import APIError, bad_request


@dataclass(frozen=True)
class RequestLimits:
    max_body_bytes: int = 4 << 20
    max_n: int = 16
    max_sequences: int = 64  # prompts x n in one request
    max_logprobs: int = MAX_LOGPROBS  # completions' logprobs, chat's top_logprobs
    max_stop: int = 16  # stop strings
    max_stop_chars: int = 256  # characters of one stop string (each is searched for after every token)
    max_tokens: int = 32768  # tokens one choice may generate (the context may bind first); the default too

    def check(self, req, num_prompts: int) -> None:
        """Raises a 400 APIError for the first bound req passes (req: a CompletionRequest or ChatRequest)."""
        _in_range("n", req.n, 1, self.max_n)
        if num_prompts * req.n > self.max_sequences:
            raise bad_request(f"{num_prompts} prompts x n={req.n} is {num_prompts * req.n} sequences; a request may "
                              f"ask for at most {self.max_sequences}", "n")
        for name in ("logprobs", "top_logprobs"):
            value = getattr(req, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                _in_range(name, value, 0, self.max_logprobs)
        stop = [req.stop] if isinstance(req.stop, str) else req.stop or []
        if len(stop) > self.max_stop:
            raise bad_request(f"stop has {len(stop)} strings; at most {self.max_stop} are allowed", "stop")
        longest = max((len(s) for s in stop), default=0)
        if longest > self.max_stop_chars:
            raise bad_request(f"a stop string has {longest} characters; each may have 1..{self.max_stop_chars}", "stop")
        for name in ("max_tokens", "max_completion_tokens"):
            value = getattr(req, name, None)
            if value is not None and value > self.max_tokens:
                raise bad_request(f"{name}={value} is more than this server allows: at most {self.max_tokens} "
                                  f"(send 1..{self.max_tokens})", name)

    async def read_body(self, request: Request) -> bytes:
        """The request body; a 413 once it passes max_body_bytes (checked while reading, not only the header)."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            raise self._too_large(int(declared))
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body_bytes:
                raise self._too_large(None)
        return bytes(body)

    def _too_large(self, size: int | None) -> APIError:
        got = f"{size} bytes" if size is not None else "more than that"
        return APIError(413, f"request body is {got}; this server accepts at most {self.max_body_bytes} bytes",
                        code="request_too_large")


def _in_range(name: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise bad_request(f"{name} must be an integer in {low}..{high} on this server, got {value}", name)
