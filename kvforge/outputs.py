"""What a request returns: RequestOutput with its text, token ids and metrics."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    prompt_tokens: int = 0
    generated_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    def as_dict(self) -> dict:
        return {
            "ttft": self.ttft,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "cached_tokens": self.cached_tokens,
            "preemptions": self.preemptions,
            "e2e": None if self.finished_time is None else self.finished_time - self.arrival_time,
        }


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]  # generated ids only
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort", "error" or None while running
    metrics: RequestMetrics
    new_token_ids: list[int] = field(default_factory=list)  # generated since the previous step
    logprobs: list[dict] | None = None
    error: str | None = None  # why the request failed, when finish_reason is "error"
