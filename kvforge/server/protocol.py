"""Request bodies of the OpenAI-compatible API, parsed strictly into pydantic models."""
from __future__ import annotations

import json
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvforge.sampling_params import SEED_RANGE
from kvforge.server.errors import APIError, bad_request

T = TypeVar("T", bound=BaseModel)


class _Body(BaseModel):
    """Unknown fields are refused (400), so a misspelled or unsupported option is never silently ignored."""

    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    model: str | None = None
    max_tokens: int | None = None
    # None: the server's default (the model's recommended sampling over SamplingParams'; GET /v1/models shows it)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])  # what a torch.Generator takes
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    cache_salt: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's extension
    logit_bias: dict[str, float] | None = None  # refused unless empty
    user: str | None = None  # OpenAI's end-user id: accepted, unused
    # vLLM's guided decoding: refused with a 400 that says so (kvforge.server.serving.refuse_unsupported)
    guided_json: object = None
    guided_regex: object = None
    guided_choice: object = None
    guided_grammar: object = None


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
    content: str | list[ContentPart] | None = None  # null only beside an assistant's tool_calls
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant's earlier calls (server/structured.py renders them)
    tool_call_id: str | None = None  # a tool result's call

    @model_validator(mode="after")
    def _content_given(self) -> Message:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content must be a string or a list of text parts, not null or missing (null content "
                             "goes only with an assistant message's tool_calls)")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatRequest(_Sampling):
    messages: list[Message]
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    # structured output and tool calls (server/structured.py); functions / function_call are refused
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None  # accepted; a reply holds at most one call
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
        raise _field_error(e, model) from None


def _field_error(e: ValidationError, model: type[BaseModel]) -> APIError:
    err = e.errors()[0]
    loc = err.get("loc", ())
    param = ".".join(str(p) for p in loc if not _is_type_tag(p)) or None
    head = param or "body"
    if err.get("type") == "extra_forbidden":
        known = ", ".join(model.model_fields) if len(loc) == 1 else "the fields the OpenAI API defines there"
        return bad_request(f"{head}: unknown field; this server does not support it and refuses it rather than "
                           f"ignore it (accepted: {known})", param=param)
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
