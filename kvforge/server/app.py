"""The OpenAI-compatible FastAPI app around one LLMEngine."""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from kvforge.engine.engine import LLMEngine
from kvforge.errors import InvalidRequestError
from kvforge.models.recommended_sampling import recommended_sampling
from kvforge.server import serving, structured
from kvforge.server.echo import add_echo, echoes
from kvforge.server.engine_loop import EngineLoop
from kvforge.server.errors import (
    APIError,
    InternalErrors,
    bad_request,
    engine_unavailable,
    model_not_found,
    unauthorized,
)
from kvforge.server.limits import RequestLimits
from kvforge.server.protocol import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    Message,
    TokenizeRequest,
    parse_body,
)
from kvforge.server.responses import Shaper, usage

TOKENIZER_THREADS = 4  # prompts tokenized at once, off the event loop


@dataclass
class ServerConfig:
    api_keys: list[str] = field(default_factory=list)
    share_prefix_cache_across_keys: bool = False
    max_waiting: int | None = 512
    served_model_name: str | None = None
    limits: RequestLimits = field(default_factory=RequestLimits)


def key_salt(key: str) -> str:
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]


class KeyChecker:
    """Constant-time API key check: the digests of every configured key are compared, whatever the candidate's
    length or which key it matches, so the time taken says nothing about the keys."""

    def __init__(self, keys: list[str]):
        self._digests = [hashlib.sha256(k.encode()).digest() for k in keys]

    def __bool__(self) -> bool:
        return bool(self._digests)

    def matches(self, candidate: str) -> bool:
        digest = hashlib.sha256(candidate.encode()).digest()
        found = False
        for d in self._digests:
            found |= hmac.compare_digest(digest, d)
        return found


def build_app(engine: LLMEngine, config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    loop = EngineLoop(engine, config.max_waiting)
    name = config.served_model_name or _model_name(engine)
    tokenizer = engine.tokenizer
    keys = KeyChecker(config.api_keys)
    limits = config.limits
    tokenizing = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="kvforge-tokenize")
    recommended = recommended_sampling(engine.loaded.path)

    async def off_loop(fn, *args, **kwargs):
        """fn on a tokenizer thread: a long prompt never stalls the event loop, so other requests keep streaming."""
        return await asyncio.get_running_loop().run_in_executor(tokenizing, partial(fn, *args, **kwargs))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loop.start()
        yield
        loop.stop()
        tokenizing.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="kvforge", lifespan=lifespan)
    app.add_middleware(InternalErrors)
    app.state.engine_loop = loop

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", kind).response()

    def authorize(request: Request) -> str | None:
        """Checks the API key; returns the tenant's cache salt (None when keys are off or shared)."""
        if not keys:
            return None
        header = request.headers.get("authorization", "")
        token = header[7:].strip() if header[:7].lower() == "bearer " else ""
        if not keys.matches(token):
            raise unauthorized()
        return None if config.share_prefix_cache_across_keys else key_salt(token)

    def check_model(model: str | None) -> None:
        if model is not None and model != name:
            raise model_not_found(model, [name])

    def salt(key: str | None, user: str | None) -> str | None:
        return ":".join(s for s in (key, user) if s) or None

    def encode(text: str, param: str, **options) -> list[int]:
        try:
            return tokenizer.encode(text, **options)
        except InvalidRequestError as e:  # e.g. a lone surrogate
            raise bad_request(f"{param}: {e}", param) from None

    def text_ids(text: str, param: str) -> list[int]:
        if tokenizer is None:
            raise bad_request("this model has no tokenizer; send token ids instead of text", param)
        if not text:
            raise bad_request(f"{param} is empty; give at least one character or token id", param)
        return encode(text, param)

    def chat_ids(messages: list[Message], plan: structured.OutputPlan | None = None) -> list[int]:
        if not messages:
            raise bad_request("messages must be a non-empty list of {'role': ..., 'content': ...} objects", "messages")
        if tokenizer is None:
            raise bad_request("this model has no tokenizer, so it cannot render chat messages", "messages")
        try:
            rendered = [structured.message_dict(m) for m in messages]
            text = tokenizer.apply_chat_template(structured.tool_messages(rendered, plan) if plan else rendered)
        except InvalidRequestError as e:
            raise bad_request(str(e), "messages") from None
        return encode(text, "messages", add_special_tokens=False)

    async def completion_prompts(req: CompletionRequest) -> list[list[int]]:
        prompt = req.prompt
        items = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
        limits.check(req, len(items))  # before the work of tokenizing
        if not any(isinstance(p, str) for p in items):
            return items  # the engine checks token ids
        return await off_loop(lambda: [text_ids(p, "prompt") if isinstance(p, str) else p for p in items])

    async def run(request: Request, req, prompts: list[list[int]], kind: str, key: str | None,
                  plan: structured.OutputPlan | None = None) -> Response:
        prepared = serving.prepare(req, prompts, engine, salt(key, req.cache_salt), kind, name, limits.max_tokens,
                                   recommended.values, plan)
        echo = getattr(req, "echo", False)
        prefixes = await echoes(loop, prompts, req.logprobs) if echo and req.stream else None
        group = await serving.submit(loop, prepared)
        if req.stream:
            return StreamingResponse(serving.stream(loop, group, prepared, tokenizer, prefixes),
                                     media_type="text/event-stream")
        body = await serving.collect(loop, group, prepared, request.is_disconnected)
        if echo:
            body = await add_echo(loop, body, prompts, req.n, req.logprobs)
        return JSONResponse(body) if body is not None else Response(status_code=499)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        key = authorize(request)
        req = parse_body(await limits.read_body(request), CompletionRequest)
        check_model(req.model)
        prompts = await completion_prompts(req)
        if req.echo and req.max_tokens == 0:  # scoring only: the prompt's logprobs, nothing generated
            serving.refuse_unsupported(req)
            try:
                prompts = [engine.check_token_ids(p) for p in prompts]
            except InvalidRequestError as e:
                raise serving.invalid(e) from None
            longest = max(len(p) for p in prompts)
            if longest > engine.max_model_len:
                raise APIError(400, f"prompt has {longest} tokens; this server's max_model_len is "
                               f"{engine.max_model_len}", param="prompt", code="context_length_exceeded")
            shaper = Shaper("completion", name, req.logprobs is not None)
            used = usage(sum(len(p) for p in prompts), 0, 0)
            if req.stream:
                prefixes = await echoes(loop, prompts, req.logprobs)
                wanted = used if req.stream_options and req.stream_options.include_usage else None
                return StreamingResponse(serving.echo_stream(shaper, prefixes, req.n, wanted),
                                         media_type="text/event-stream")
            choices = [shaper.choice(i, "", "length", []) for i in range(len(prompts) * req.n)]
            body = shaper.response(choices, used)
            return JSONResponse(await add_echo(loop, body, prompts, req.n, req.logprobs))
        return await run(request, req, prompts, "completion", key)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        key = authorize(request)
        req = parse_body(await limits.read_body(request), ChatRequest)
        check_model(req.model)
        limits.check(req, 1)
        plan = structured.plan_output(req)
        return await run(request, req, [await off_loop(chat_ids, req.messages, plan)], "chat", key, plan)

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        authorize(request)
        card = {"id": name, "object": "model", "created": int(time.time()), "owned_by": "kvforge",
                "max_model_len": engine.max_model_len, "vocab_size": engine.model_config.vocab_size,
                "sampling_defaults": serving.sampling_defaults(recommended.values),
                "sampling_defaults_source": (f"{recommended.source}, over the OpenAI API's defaults" if recommended
                                             else "the OpenAI API's defaults (the model recommends none)")}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> Response:
        if not loop.alive:
            reason = f"died ({type(loop.error).__name__}: {loop.error})" if loop.error else "is not running"
            return engine_unavailable(f"unhealthy: the engine loop {reason}").response()
        return JSONResponse({"status": "ok"})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        authorize(request)
        req = parse_body(await limits.read_body(request), TokenizeRequest)
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("send exactly one of prompt or messages", "prompt")
        if req.messages is not None:
            ids = await off_loop(chat_ids, req.messages)
        elif tokenizer is None:
            raise bad_request("this model has no tokenizer", "prompt")
        else:
            ids = await off_loop(encode, req.prompt, "prompt", add_special_tokens=req.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        authorize(request)
        req = parse_body(await limits.read_body(request), DetokenizeRequest)
        check_model(req.model)
        if tokenizer is None:
            raise bad_request("this model has no tokenizer", "tokens")
        try:
            ids = engine.check_token_ids(req.tokens, "tokens")
        except InvalidRequestError as e:
            raise bad_request(str(e), "tokens") from None
        return {"prompt": await off_loop(tokenizer.decode, ids)}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        stats = {**await loop.call(lambda e: e.stats()), "outputs_held": loop.held_outputs()[0]}
        return PlainTextResponse(loop.metrics.render(stats), media_type="text/plain; version=0.0.4")

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> dict:
        authorize(request)
        freed = await loop.call(lambda e: e.kv.reset_prefix_cache())
        return {"freed_blocks": freed}

    return app


def _model_name(engine: LLMEngine) -> str:
    base = os.path.basename(os.path.normpath(engine.loaded.path))
    return base.removesuffix(".gguf")
