"""`echo` on /v1/completions: the prompt's text and, with logprobs, its per-token log-probabilities.

Evaluation harnesses score likelihoods this way (echo=true, max_tokens=0, logprobs=k). The prompt is
scored through the engine's own cache (kvforge.engine.scoring) on the engine loop thread, between steps.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvforge.engine.sampler import top_logprobs
from kvforge.engine.scoring import position_logits
from kvforge.errors import OutOfKVMemoryError
from kvforge.server.errors import APIError
from kvforge.server.responses import completion_logprobs


def prompt_logprob_entries(engine, ids: list[int], k: int) -> list[dict]:
    """One entry per prompt token; the first has no logprob (nothing predicts it)."""
    decode = engine.tokenizer.decode
    first = {"token_id": ids[0], "token": decode([ids[0]]), "logprob": None, "top": None}
    if len(ids) == 1:
        return [first]
    bs = engine.kv.block_size
    chunk = max(bs, engine.config.max_num_batched_tokens // bs * bs)  # as prefill would, block-aligned
    logits = position_logits(engine, ids, chunk)
    rest = [top_logprobs(logits[i], ids[i + 1], k, decode) for i in range(len(ids) - 1)]
    return [first, *rest]


def echo_logprobs(prompt_entries: list[dict], generated: dict | None, prompt_text: str) -> dict:
    """The legacy logprobs object over prompt + completion, offsets counted from the prompt's start."""
    out = completion_logprobs([{**e, "top": e["top"] or []} for e in prompt_entries], 0)
    out["top_logprobs"][0] = None
    if generated:
        out["tokens"] += generated["tokens"]
        out["token_logprobs"] += generated["token_logprobs"]
        out["top_logprobs"] += generated["top_logprobs"]
        out["text_offset"] += [len(prompt_text) + o for o in generated["text_offset"]]
    return out


@dataclass
class Echo:
    """What a completion choice is prefixed with: its prompt's text and, when asked, the prompt's logprobs."""
    text: str
    entries: list[dict] | None

    def logprobs(self, generated: dict | None) -> dict | None:
        return None if self.entries is None else echo_logprobs(self.entries, generated, self.text)


async def echoes(loop, prompts: list[list[int]], logprobs: int | None) -> list[Echo]:
    """One Echo per prompt, scored on the engine loop thread between steps."""
    texts = [await loop.call(lambda e, ids=ids: e.tokenizer.decode(ids)) for ids in prompts]
    if logprobs is None:
        return [Echo(t, None) for t in texts]
    try:
        entries = [await loop.call(lambda e, ids=ids: _score(e, ids, logprobs)) for ids in prompts]
    except OutOfKVMemoryError as e:
        raise APIError(503, f"no room in the KV cache to score the prompt for echo right now ({e}); retry later",
                       "server_error") from None
    return [Echo(t, x) for t, x in zip(texts, entries)]


async def add_echo(loop, body: dict | None, prompts: list[list[int]], n: int, logprobs: int | None) -> dict | None:
    """Prefix each choice of a completions body with its prompt (text, and logprobs when asked)."""
    if body is None:
        return None
    prefixes = await echoes(loop, prompts, logprobs)
    for choice in body["choices"]:
        echo = prefixes[choice["index"] // n]
        if echo.entries is not None:
            choice["logprobs"] = echo.logprobs(choice.get("logprobs"))
        choice["text"] = echo.text + choice["text"]
    return body


def _score(engine, ids: list[int], k: int) -> list[dict]:
    with torch.inference_mode():
        return prompt_logprob_entries(engine, ids, k)
