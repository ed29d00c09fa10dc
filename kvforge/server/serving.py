"""Turn an OpenAI request into engine submissions, then collect or stream the outputs."""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from kvforge.errors import InvalidRequestError, PromptTooLongError
from kvforge.outputs import RequestOutput
from kvforge.sampling_params import SEED_RANGE, SamplingParams
from kvforge.server.echo import Echo
from kvforge.server.engine_loop import EngineLoop, RequestGroup, Submission
from kvforge.server.errors import APIError, bad_request, server_error
from kvforge.server.protocol import ChatRequest, CompletionRequest
from kvforge.server.responses import ChoiceText, Shaper, usage
from kvforge.server.structured import OutputPlan, tool_calls

DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is still there
_PARAMS = ("prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "logprobs", "presence_penalty",
           "frequency_penalty", "repetition_penalty")


@dataclass
class Prepared:
    prompts: list[list[int]]
    n: int
    subs: list[Submission]
    shaper: Shaper
    stop: list[str]
    include_usage: bool
    plan: OutputPlan | None = None  # chat: response_format / tools (server/structured.py)


SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty")


def sampling_defaults(recommended: dict) -> dict:
    """What a request's unset sampling fields take: the model's recommended sampling over SamplingParams' defaults."""
    base = SamplingParams()
    return {name: recommended.get(name, getattr(base, name)) for name in SAMPLING_FIELDS}


def prepare(req: CompletionRequest | ChatRequest, prompts: list[list[int]], engine, cache_salt: str | None,
            kind: str, model: str, max_tokens_limit: int, defaults: dict | None = None,
            plan: OutputPlan | None = None) -> Prepared:
    refuse_unsupported(req)
    grammar = plan.grammar if plan is not None else None
    if isinstance(req, CompletionRequest):
        max_tokens, default_max, logprobs, want_lp = req.max_tokens, 16, req.logprobs, req.logprobs is not None
    else:
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        default_max, want_lp = None, req.logprobs
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    if req.seed is not None and req.seed + req.n - 1 > SEED_RANGE[1]:
        raise bad_request(f"seed={req.seed} with n={req.n}: choice j samples with seed + j, so seed may be at most "
                          f"2**64 - n = {SEED_RANGE[1] - req.n + 1}", "seed")
    sampling = {**sampling_defaults(defaults or {}),
                **{k: getattr(req, k) for k in SAMPLING_FIELDS if getattr(req, k) is not None}}
    limit = engine.length_limit  # the engine's own bound on prompt + output (beyond max_model_len when streaming)
    subs = []
    for ids in prompts:
        room = limit - len(ids)
        if room < 1:
            raise APIError(400, f"prompt has {len(ids)} tokens; this server's max_model_len is {limit}"
                           f"{engine.capped_note()}, so a prompt must have at most {limit - 1} tokens",
                           param="prompt", code="context_length_exceeded")
        if max_tokens is not None and max_tokens > room:
            raise APIError(400, f"max_tokens={max_tokens} does not fit: the prompt has {len(ids)} tokens and "
                           f"max_model_len is {limit}, so max_tokens may be at most {room}", param="max_tokens",
                           code="context_length_exceeded")
        n_tokens = max_tokens if max_tokens is not None else min(default_max or room, room, max_tokens_limit)
        for j in range(req.n):
            seed = None if req.seed is None else req.seed + j
            try:
                params = SamplingParams(max_tokens=n_tokens, seed=seed, stop=req.stop, ignore_eos=req.ignore_eos,
                                        logprobs=logprobs, structured_outputs=grammar, **sampling)
            except InvalidRequestError as e:
                raise invalid(e) from None
            subs.append(Submission(ids, params, cache_salt))
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return Prepared(prompts, req.n, subs, Shaper(kind, model, want_lp), subs[0].params.stop, include_usage, plan)


def refuse_unsupported(req: CompletionRequest | ChatRequest) -> None:
    """Features this server does not implement get a 400 that says so, not a plain-text 200."""
    guided = [f for f in ("guided_json", "guided_regex", "guided_choice", "guided_grammar") if getattr(req, f) is not None]
    if guided:
        raise bad_request(f"{guided[0]} (vLLM's guided decoding) is not supported by this server; use "
                          "response_format (json_object, json_schema) or tools", guided[0])
    if req.logit_bias:
        raise bad_request("logit_bias is not supported; send the request without it", "logit_bias")
    if isinstance(req, CompletionRequest):
        if req.suffix:
            raise bad_request("suffix (fill-in-the-middle) is not supported; send the request without it", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request(f"best_of is not supported (best_of={req.best_of}, n={req.n}); use n", "best_of")
        return


def invalid(e: InvalidRequestError) -> APIError:
    word = str(e).split(" ", 1)[0].rstrip(":")
    code = "context_length_exceeded" if isinstance(e, PromptTooLongError) else None
    return bad_request(str(e), word if word in _PARAMS else None, code)


async def submit(loop: EngineLoop, p: Prepared) -> RequestGroup:
    try:
        return await loop.submit(p.subs)
    except InvalidRequestError as e:
        raise invalid(e) from None


def _usage(p: Prepared, finals: dict[int, RequestOutput]) -> dict:
    cached = sum(o.metrics.cached_tokens for i, o in finals.items() if i % p.n == 0)
    return usage(sum(len(ids) for ids in p.prompts), sum(len(o.token_ids) for o in finals.values()), cached)


async def collect(loop: EngineLoop, group: RequestGroup, p: Prepared,
                  disconnected: Callable[[], Awaitable[bool]]) -> dict | None:
    """The response body, or None when the client went away (its requests are aborted)."""
    finals: dict[int, RequestOutput] = {}
    checked = time.monotonic()
    try:
        while len(finals) < len(group.ids):
            if time.monotonic() - checked > DISCONNECT_POLL_S:
                checked = time.monotonic()
                if await disconnected():
                    return None
            try:
                items = await asyncio.wait_for(group.mailbox.get(), timeout=DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                continue
            for index, item in items:
                if isinstance(item, Exception):
                    raise _api_error(item)
                if item.finished:
                    finals[index] = item
    finally:
        left = [rid for i, rid in enumerate(group.ids) if i not in finals]
        if left:
            loop.abort(left)
    choices = [p.shaper.choice(i, o.text, o.finish_reason, o.logprobs or [], _calls(p, o))
               for i, o in sorted(finals.items())]
    return p.shaper.response(choices, _usage(p, finals))


async def stream(loop: EngineLoop, group: RequestGroup, p: Prepared, tokenizer,
                 echoes: list[Echo] | None = None) -> AsyncIterator[str]:
    """Server-sent events; aborts the unfinished requests when the client goes away (the generator is cancelled).
    With `echoes` (completions' echo), each choice's first chunk is its prompt; generated offsets follow it."""
    finals: dict[int, RequestOutput] = {}
    try:
        texts = [ChoiceText(tokenizer, p.prompts[i // p.n], p.stop) for i in range(len(group.ids))]
        shift = [len(echoes[i // p.n].text) if echoes else 0 for i in range(len(group.ids))]
        holding = p.plan is not None and p.plan.tool_mode is not None
        if p.shaper.kind == "chat":
            for i in range(len(group.ids)):
                yield _sse(p.shaper.chunk(i, "", None, role=True))
        for i in range(len(group.ids) if echoes else 0):
            yield _sse(echo_chunk(p.shaper, i, echoes[i // p.n]))
        while len(finals) < len(group.ids):
            for index, item in await group.mailbox.get():
                if isinstance(item, Exception):
                    raise item
                if holding:  # a tool call or an answer: known only once the reply is whole
                    if item.finished:
                        finals[index] = item
                        yield from_final(p, index, item)
                    continue
                t = texts[index]
                offset = shift[index] + len(t.sent)
                delta = t.delta(item.new_token_ids, item.finished, item.text)
                logprobs = t.new_logprobs(item.logprobs)
                if item.finished:
                    finals[index] = item
                if delta or logprobs or item.finished:
                    reason = item.finish_reason if item.finished else None
                    yield _sse(p.shaper.chunk(index, delta or None, reason, logprobs, offset))
        if p.include_usage and len(finals) == len(group.ids):
            yield _sse(p.shaper.usage_chunk(_usage(p, finals)))
        yield "data: [DONE]\n\n"
    except Exception as e:  # noqa: BLE001 - the status line is sent: the error goes in the stream, which then ends
        yield _sse(_api_error(e).body())
    finally:
        left = [rid for i, rid in enumerate(group.ids) if i not in finals]
        if left:
            loop.abort(left)


def _calls(p: Prepared, o: RequestOutput) -> list[dict] | None:
    return tool_calls(o.text, p.plan) if p.plan is not None and o.finish_reason != "error" else None


def from_final(p: Prepared, index: int, o: RequestOutput) -> str:
    """The chunk of a held reply: its tool calls, or its whole text."""
    calls = _calls(p, o)
    if calls:
        return _sse(p.shaper.chunk(index, None, "tool_calls", tool_calls=calls))
    return _sse(p.shaper.chunk(index, o.text, o.finish_reason))


def echo_chunk(shaper: Shaper, index: int, echo: Echo, finish_reason: str | None = None) -> dict:
    chunk = shaper.chunk(index, echo.text, finish_reason)
    chunk["choices"][0]["logprobs"] = echo.logprobs(None)
    return chunk


async def echo_stream(shaper: Shaper, echoes: list[Echo], n: int, usage_: dict | None) -> AsyncIterator[str]:
    """A streamed echo with nothing generated (max_tokens 0): one chunk per choice, its prompt."""
    for i in range(len(echoes) * n):
        yield _sse(echo_chunk(shaper, i, echoes[i // n], "length"))
    if usage_ is not None:
        yield _sse(shaper.usage_chunk(usage_))
    yield "data: [DONE]\n\n"


def _api_error(e: Exception) -> APIError:
    """What a client is told about an error delivered in place of an output (or raised while streaming)."""
    if isinstance(e, APIError):
        return e
    return server_error(f"the server failed while running this request: {type(e).__name__}: {e}")


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
