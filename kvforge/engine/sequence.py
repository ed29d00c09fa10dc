"""Sequence: one request's tokens, progress, sampling state and status (its KV state lives in the KVCacheManager)."""
from __future__ import annotations

import enum

import torch

from kvforge.outputs import RequestMetrics
from kvforge.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    LOADING = "loading"  # its prefix blocks are being fetched from KV tiers
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_time: float, cache_salt: str | None = None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)
        self.params = params
        self.cache_salt = cache_salt
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose K/V were computed; the scheduler owns it
        self.finish_reason: str | None = None
        self.stop_text_len: int | None = None  # text is cut here when a stop string matched
        self.metrics = RequestMetrics(arrival_time=arrival_time, prompt_tokens=len(prompt_token_ids))
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)
        self.grammar = None  # engine/grammar.RequestGrammar for structured output; the engine feeds it every token
        self.logprobs: list[dict] = []
        self.num_returned = 0  # generated tokens already reported by step()
        self.overtaken_tokens = 0  # prefill tokens of later requests started before it (engine/prefill_order.py)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
