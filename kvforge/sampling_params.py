"""SamplingParams: how one request is decoded (vLLM-shaped), validated on construction."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvforge.errors import InvalidRequestError

MAX_LOGPROBS = 20  # top alternatives a request may ask for per token


@dataclass
class SamplingParams:
    """temperature=0 is greedy. top_k <= 0 and top_p == 1 disable those filters."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        checks = [
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1, f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"),
            (_number(self.temperature) and self.temperature >= 0, f"temperature must be a number >= 0 (0 = greedy), got {self.temperature!r}"),
            (_number(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}"),
            (isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 0), f"top_k must be -1 (off), 0 (off) or a positive integer, got {self.top_k!r}"),
            (self.seed is None or isinstance(self.seed, int), f"seed must be an integer or None, got {self.seed!r}"),
            (all(isinstance(s, str) and s for s in self.stop), f"stop must be non-empty strings, got {self.stop!r}"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), f"stop_token_ids must be token ids >= 0, got {self.stop_token_ids!r}"),
            (self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS), f"logprobs must be None or an integer in 0..{MAX_LOGPROBS}, got {self.logprobs!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and not math.isnan(x)
