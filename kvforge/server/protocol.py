"""Request bodies of the OpenAI-compatible API, parsed strictly into pydantic models."""
from __future__ import annotations

import json
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvforge.sampling_params import SEED_RANGE
from kvforge.server.errors import APIError, bad_request

T = TypeVar("T", bound=BaseModel)


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])  # what a torch.Generator takes
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    cache_salt: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM's extension
    logit_bias: dict[str, float] | None = None  # refused unless empty


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None  # refused (no fill-in-the-middle)
    best_of: int | None = None  # refused unless equal to n


class ContentPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatRequest(_Sampling):
    messages: list[Message]
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    # not supported: refused with a 400 (kvforge.server.serving.refuse_unsupported), never ignored
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    functions: list[dict] | None = None
    function_call: str | dict | None = None
    response_format: dict | None = None


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


def parse_body(raw: bytes, model: type[T]) -> T:
    """Bytes -> model, with a 400 that names what is wrong: encoding, JSON syntax or a field."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"request body is not valid UTF-8 (byte {e.start}); send UTF-8 encoded JSON") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise bad_request(f"request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:
        raise bad_request("request body nests JSON arrays or objects too deeply; send a flat request object") from None
    if not isinstance(data, dict):
        raise bad_request(f"request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise _field_error(e) from None


def _field_error(e: ValidationError) -> APIError:
    err = e.errors()[0]
    loc = err.get("loc", ())
    param = ".".join(str(p) for p in loc if not _is_type_tag(p)) or None
    head = param or "body"
    given = err.get("input")
    shown = json.dumps(given)[:80] if _jsonable(given) else repr(given)[:80]
    shown = "" if err.get("type") == "missing" else f" (got {shown})"
    return bad_request(f"{head}: {err.get('msg', 'invalid value')}{shown}", param=param)


def _is_type_tag(p) -> bool:
    """pydantic names the union member that failed (e.g. 'list[int]') inside loc; the client never wrote it."""
    return isinstance(p, str) and ("[" in p or p in {"str", "int", "float", "bool", "list"})


def _jsonable(x) -> bool:
    try:
        json.dumps(x)
        return True
    except (TypeError, ValueError):
        return False
