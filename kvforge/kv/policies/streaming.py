"""StreamingLLM: attention sinks plus a recent window, with positions inside the cache."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvforge.errors import ConfigError
from kvforge.kv.policies.base import KVPolicy, PolicyState, recent


@dataclass
class StreamingPolicy(KVPolicy):
    """StreamingLLM (Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024,
    arXiv:2309.17453): keep the first `sinks` tokens forever and the `budget - sinks` most recent.

    Attention sees cache-index distances, as in the paper. New tokens are rotated at their logical
    position (cache index + tokens dropped so far); on compaction the recent rows shift by exactly the
    tokens dropped, so their distances hold and they move as stored (no re-encoding of quantized rows),
    while the sinks are re-rotated by +dropped (RoPE rotations compose). The cache is bounded, so a
    sequence may run far past the model's context length. budget must be a token count.
    """

    name = "streaming"
    default_budget = 1024  # when no budget is given
    rope_by_cache_index = True
    sinks: int = 4

    def __post_init__(self):
        super().__post_init__()
        if self.budget is not None and not isinstance(self.budget, int):
            raise ConfigError(f"streaming: budget must be a token count (the cache is bounded), got {self.budget!r}")
        if not isinstance(self.sinks, int) or self.sinks < 0 or (self.budget is not None and self.sinks >= self.budget):
            raise ConfigError(f"streaming: sinks must be an integer in [0, budget), got {self.sinks!r}")

    def select(self, length: int, budget: int, state: PolicyState) -> torch.Tensor:
        sinks = min(self.sinks, length)
        tail = recent(length, budget - self.sinks)
        return torch.cat([torch.arange(sinks), tail[tail >= sinks]])
