"""H2O: heavy hitters (largest accumulated attention) plus a recent window."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvforge.errors import ConfigError
from kvforge.kv.policies.base import KVPolicy, PolicyState, check_query_heads, check_weight, top_with_recent


@dataclass
class H2OPolicy(KVPolicy):
    """H2O, Heavy-Hitter Oracle (Zhang et al., NeurIPS 2023, arXiv:2306.14048): every token accumulates
    the attention it receives from every later query; keep the `budget - recent` tokens with the largest
    sum (the heavy hitters) plus the `recent` newest tokens.

    recent: a token count, or a fraction of the budget. The paper splits evenly (0.5); on SmolLM2-135M a
        larger recent share measured better (8k tokens, budget 0.5: +3.31% at 0.5, +2.53% at 0.75), so 0.75.
    sinks: the first tokens of the sequence, always kept (StreamingLLM's attention sinks; default 0).
    score: "sum" (the paper: attention accumulated over every later query) or "mean" (that sum over the
        number of queries that could attend to the token, so old tokens are not favoured for their age).
    scope: "head" (the paper: each layer and KV head keeps its own heavy hitters), "layer" (heads summed),
        or "sequence" (layers and heads summed: one kept set per sequence). Keys keep logical positions.
    decay: each step first multiplies the scores by decay ** (its queries), so attention long ago counts
        less (1.0, the default, is the paper's plain sum; near 0 keeps what the latest queries attend to).
    weight: "attention" (the paper) or "value": the score times the L1 norm of the row's value in that KV head
        (VATP, Guo et al., "Attention Score is not All You Need for Token Importance Indicator in KV Cache
        Reduction: Value Also Matters", EMNLP 2024, arXiv:2406.12335): a row the queries attend to but whose
        value is near zero (an attention sink) adds little to the output. Needs scope "head".
    pool: an odd window; each row's score becomes the largest within pool // 2 cache indices of it (SnapKV's
        pooling, applied at every compaction), so the neighbours of a heavy hitter stay with it (1: off).
    query_heads: how the query heads sharing a KV head (GQA) combine: "sum" (their softmax rows added, the
        paper) or "max" (each key's largest probability over them: a key that one query head needs keeps its
        weight even when the group's other heads ignore it). Each query's combined row is normalized to sum 1.
    """

    name = "h2o"
    default_budget = 0.5  # when no budget is given
    needs_attention = True
    sums_queries = True
    scopes = ("sequence", "layer", "head")
    recent: int | float = 0.75
    sinks: int = 0
    score: str = "sum"
    scope: str = "head"
    decay: float = 1.0
    weight: str = "attention"
    pool: int = 1
    query_heads: str = "sum"

    def __post_init__(self):
        super().__post_init__()
        check_query_heads(self, self.query_heads)
        if self.score not in ("sum", "mean"):
            raise ConfigError(f"h2o: score must be 'sum' or 'mean', got {self.score!r}")
        if not isinstance(self.decay, (int, float)) or not 0 < self.decay <= 1:
            raise ConfigError(f"h2o: decay must be a number in (0, 1], got {self.decay!r}")
        check_weight(self, self.weight)
        if not isinstance(self.pool, int) or isinstance(self.pool, bool) or self.pool < 1 or self.pool % 2 == 0:
            raise ConfigError(f"h2o: pool must be an odd integer >= 1, got {self.pool!r}")

    @property
    def weighs_values(self) -> bool:
        return self.weight == "value"

    def num_recent(self, budget: int) -> int:
        return int(self.recent * budget) if isinstance(self.recent, float) else min(self.recent, budget)

    def observe(self, state: PolicyState, attn: torch.Tensor, queries: int | None = None) -> None:
        rows, length = attn.shape[-2:]
        state.grow(length, attn.shape[:-2])
        if self.decay < 1:
            state.scores *= self.decay ** (queries or rows)
        state.scores[..., :length] += attn.sum(-2)
        if self.score == "mean":
            at = torch.arange(length - (queries or rows), length)
            state.seen[..., :length] += (torch.arange(length)[None, :] <= at[:, None]).sum(0)

    def select(self, length: int, budget: int, state: PolicyState) -> torch.Tensor:
        state.grow(length)
        scores = state.scores[..., :length]
        if self.score == "mean":
            scores = scores / state.seen[..., :length].clamp_min(1)
        if self.weighs_values:
            scores = scores * state.values[..., :length]
        if self.pool > 1:
            flat = scores.reshape(-1, 1, length)
            scores = F.max_pool1d(flat, self.pool, stride=1, padding=self.pool // 2).view(scores.shape)
        return top_with_recent(scores, budget, self.num_recent(budget), self.sinks)
