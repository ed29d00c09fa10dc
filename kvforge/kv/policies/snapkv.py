"""SnapKV: compress the prompt once, by the votes of an observation window at its end."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvforge.errors import ConfigError
from kvforge.kv.policies.base import KVPolicy, PolicyState, SequenceView, top_with_recent


@dataclass
class SnapKVPolicy(KVPolicy):
    """SnapKV (Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", 2024,
    arXiv:2404.14469).

    When the prompt's prefill completes, the last `window` prompt queries vote: their attention over
    the earlier prompt tokens is summed, pooled along the sequence (`pooling` 'max' or 'avg' with
    `kernel`, so neighbours of a hit survive too) and the top budget - window tokens plus the window are
    kept. Generated tokens are all kept: the budget bounds the prompt, once. Votes are summed over
    layers and heads (one kept set per sequence). A budget fraction is a fraction of the prompt.
    """

    name = "snapkv"
    default_budget = 0.5  # when no budget is given
    needs_attention = True
    window: int = 32
    kernel: int = 5
    pooling: str = "max"

    def __post_init__(self):
        super().__post_init__()
        if self.pooling not in ("max", "avg") or self.kernel < 1 or self.kernel % 2 == 0 or self.window < 1:
            raise ConfigError("snapkv: pooling must be 'max' or 'avg', kernel an odd integer >= 1, window >= 1; "
                              f"got {self.pooling!r}, {self.kernel!r}, {self.window!r}")

    def attention_rows(self, seq: SequenceView, num_new: int) -> int:
        done = seq.state.selected or seq.state.pending
        ends_prompt = seq.num_computed_tokens + num_new >= seq.prompt_len
        return 0 if done or not ends_prompt else min(num_new, self.window)

    def observe(self, state: PolicyState, attn: torch.Tensor) -> None:
        if state.selected or state.pending:
            return
        votes = attn.sum(0)[None, None]
        pad = self.kernel // 2
        if self.pooling == "max":
            pooled = F.max_pool1d(votes, self.kernel, stride=1, padding=pad)
        else:
            pooled = F.avg_pool1d(votes, self.kernel, stride=1, padding=pad, count_include_pad=False)
        state.scores = pooled[0, 0]
        state.pending = True

    def keep(self, seq: SequenceView, drop_unit: int = 1) -> torch.Tensor | None:  # one compression: kept as is
        state = seq.state
        if not state.pending:
            return None
        state.pending, state.selected = False, True
        state.grow(seq.cache_len)
        keep = self.select(seq.cache_len, self.budget_for(seq.num_computed_tokens), state)
        return keep if keep.shape[0] < seq.cache_len else None

    def select(self, length: int, budget: int, state: PolicyState) -> torch.Tensor:
        return top_with_recent(state.scores[:length], budget, min(self.window, budget))
