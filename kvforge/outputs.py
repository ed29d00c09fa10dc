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


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability at one position (vLLM's `Logprob`): rank 1 is the most likely token."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One sample of a prompt (vLLM's shape): RequestOutput.outputs holds n of them. logprobs: per generated token,
    {token id: Logprob} for the sampled token and the top alternatives asked for (None unless asked)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[int, Logprob]] | None = None


def vllm_logprobs(steps: list[dict] | None) -> list[dict[int, Logprob]] | None:
    """The engine's per-token records ({token_id, token, logprob, rank, top}) in vLLM's shape."""
    if steps is None:
        return None
    shaped = []
    for step in steps:
        position = {alt["token_id"]: Logprob(alt["logprob"], rank, alt["token"])
                    for rank, alt in enumerate(step.get("top", []), start=1)}
        position.setdefault(step["token_id"], Logprob(step["logprob"], step.get("rank"), step["token"]))
        shaped.append(position)
    return shaped


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
    logprobs: list[dict] | None = None  # the engine's records; `outputs[i].logprobs` has vLLM's shape
    error: str | None = None  # why the request failed, when finish_reason is "error"
    extra_samples: list[RequestOutput] = field(default_factory=list, repr=False)  # samples 2..n when n > 1

    @property
    def outputs(self) -> list[CompletionOutput]:
        """Every sample of this prompt: this output's own text first, then the n - 1 others."""
        return [CompletionOutput(i, o.text, o.token_ids, o.finish_reason, vllm_logprobs(o.logprobs))
                for i, o in enumerate([self, *self.extra_samples])]
