"""Response bodies: completion / chat results and stream chunks, logprobs, usage."""
from __future__ import annotations

import time
import uuid
from collections.abc import Sequence

from kvforge.models.tokenizer import IncrementalDetokenizer


class ChoiceText:
    """Text deltas of one choice while streaming; holds back enough characters that a stop string is never leaked."""

    def __init__(self, tokenizer, prompt_ids: Sequence[int], stop: Sequence[str]):
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids=prompt_ids) if tokenizer is not None else None
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.sent = ""
        self.logprobs_sent = 0

    def delta(self, new_token_ids: Sequence[int], finished: bool, final_text: str) -> str:
        if self.detok is None:
            return ""
        for t in new_token_ids:
            self.detok.add(t)
        if finished:
            d, self.sent = final_text[len(self.sent):], final_text
            return d
        visible = self.detok.text[: max(len(self.sent), len(self.detok.text) - self.hold)]
        d, self.sent = visible[len(self.sent):], visible
        return d

    def new_logprobs(self, logprobs: list[dict] | None) -> list[dict]:
        if not logprobs:
            return []
        new = logprobs[self.logprobs_sent:]
        self.logprobs_sent = len(logprobs)
        return new


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_logprobs(entries: list[dict], offset: int) -> dict:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs, text_offset."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top"]} for e in entries],
        "text_offset": offsets,
    }


def chat_logprobs(entries: list[dict]) -> dict:
    def item(e: dict) -> dict:
        return {"token": e["token"], "logprob": e["logprob"], "bytes": list(e["token"].encode("utf-8"))}

    return {"content": [{**item(e), "top_logprobs": [item(t) for t in e["top"]]} for e in entries]}


class Shaper:
    """Builds the JSON objects of one endpoint (kind 'completion' or 'chat') for one request."""

    def __init__(self, kind: str, model: str, want_logprobs: bool):
        self.kind, self.model, self.want_logprobs = kind, model, want_logprobs
        self.id = new_id("cmpl" if kind == "completion" else "chatcmpl")
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _logprobs(self, entries: list[dict], offset: int):
        if not self.want_logprobs:
            return None
        return completion_logprobs(entries, offset) if self.kind == "completion" else chat_logprobs(entries)

    def choice(self, index: int, text: str, finish_reason: str | None, logprobs: list[dict],
               tool_calls: list[dict] | None = None) -> dict:
        lp = self._logprobs(logprobs, 0)
        if self.kind == "completion":
            return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason}
        if tool_calls:
            return {"index": index, "message": {"role": "assistant", "content": None, "tool_calls": tool_calls},
                    "logprobs": lp, "finish_reason": "tool_calls"}
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                "finish_reason": finish_reason}

    def response(self, choices: list[dict], usage_: dict) -> dict:
        obj = "text_completion" if self.kind == "completion" else "chat.completion"
        return {**self._head(obj), "choices": choices, "usage": usage_}

    def chunk(self, index: int, text: str | None, finish_reason: str | None, logprobs: list[dict] | None = None,
              offset: int = 0, role: bool = False, tool_calls: list[dict] | None = None) -> dict:
        lp = self._logprobs(logprobs or [], offset) if logprobs else None
        if self.kind == "completion":
            choice = {"index": index, "text": text or "", "logprobs": lp, "finish_reason": finish_reason}
            return {**self._head("text_completion"), "choices": [choice]}
        delta: dict = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(tool_calls)]
        choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
        return {**self._head("chat.completion.chunk"), "choices": [choice]}

    def usage_chunk(self, usage_: dict) -> dict:
        obj = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        return {**self._head(obj), "choices": [], "usage": usage_}
