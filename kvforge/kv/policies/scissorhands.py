"""Scissorhands: keep tokens whose importance persisted over a history window."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvforge.kv.policies.base import (
    KVPolicy,
    PolicyState,
    SequenceView,
    check_query_heads,
    check_weight,
    top_with_recent,
)


@dataclass
class ScissorhandsPolicy(KVPolicy):
    """Scissorhands (Liu et al., "Exploiting the Persistence of Importance Hypothesis for LLM KV Cache
    Compression at Test Time", NeurIPS 2023, arXiv:2305.17118).

    A token is important to a query when it gets more than the uniform share (1 / keys visible) of that
    query's attention. Over the last `history` queries each token counts how often it was important;
    compaction keeps the `recent` newest tokens and the most persistently important others.
    recent: a token count or a fraction of the budget (default 0.25). sinks: the first tokens, always kept
    (default 0). scope: "head" (each layer and KV head counts and keeps its own tokens), "layer", or
    "sequence" (attention summed over layers and heads: one kept set per sequence).
    weight: "attention" (the paper) or "value": a token is important to a query when its attention times the
        L1 norm of its value row exceeds the uniform share of that query's sum of such products (after VATP,
        arXiv:2406.12335: a sink with a near-zero value adds little to the output). Needs scope "head".
    query_heads: "sum" (the query heads sharing a KV head add their attention) or "max" (each key's largest
        probability over them), as for h2o; each combined row is normalized to sum 1 before it is compared.
    """

    name = "scissorhands"
    default_budget = 0.5  # when no budget is given
    needs_attention = True
    scopes = ("sequence", "layer", "head")
    history: int = 256
    recent: int | float = 0.25
    sinks: int = 0
    scope: str = "head"
    weight: str = "attention"
    query_heads: str = "sum"

    def __post_init__(self):
        super().__post_init__()
        check_query_heads(self, self.query_heads)
        check_weight(self, self.weight)

    @property
    def weighs_values(self) -> bool:
        return self.weight == "value"

    def attention_rows(self, seq: SequenceView, num_new: int) -> int:
        return min(num_new, self.history)  # older rows would fall out of the history at once

    def observe(self, state: PolicyState, attn: torch.Tensor, queries: int | None = None) -> None:
        rows, length = attn.shape[-2:]
        if state.history is None:
            state.history = torch.zeros(0, *attn.shape[:-2], length, dtype=torch.bool)
        state.grow(length, attn.shape[:-2])
        visible = torch.arange(length - rows + 1, length + 1, dtype=attn.dtype)
        if self.weighs_values:
            attn = attn * state.values[..., None, :length]
            important = attn > attn.sum(-1, keepdim=True) / visible[:, None]
        else:
            important = attn > 1.0 / visible[:, None]
        important = important.movedim(-2, 0)  # [rows, ..., length]
        state.history = torch.cat([state.history[..., : length], important])[-self.history:]

    def select(self, length: int, budget: int, state: PolicyState) -> torch.Tensor:
        state.grow(length)
        counts = state.history.sum(0)[..., :length] if state.history is not None else torch.zeros(length)
        counts = counts + torch.arange(length) / (2.0 * length)  # ties go to the newer token
        recent = int(self.recent * budget) if isinstance(self.recent, float) else min(self.recent, budget)
        return top_with_recent(counts, budget, recent, self.sinks)
