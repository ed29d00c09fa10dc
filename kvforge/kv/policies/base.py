"""KVPolicy: which cached tokens of a sequence to keep (the protocol every eviction policy follows).

One kept set per sequence, shared by every layer and KV head (attention statistics are summed over
layers and heads), so a sequence keeps one block table. A policy sees the attention rows of the
tokens the step just computed (when it asks for them) and answers the cache indices to keep.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvforge.errors import ConfigError


@dataclass
class PolicyState:
    """Per-sequence statistics, indexed by cache index along the last axis."""

    scores: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    seen: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # queries that could attend to each (h2o mean)
    history: torch.Tensor | None = None  # [rows, cache_len] per-query importance (scissorhands)
    pending: bool = False  # snapkv: votes are in, the prompt is compressed at the next keep()
    selected: bool = False  # snapkv: the prompt was compressed

    def grow(self, length: int) -> None:
        if self.scores.shape[0] < length:
            self.scores = torch.cat([self.scores, self.scores.new_zeros(length - self.scores.shape[0])])
        if self.seen.shape[0] < length:
            self.seen = torch.cat([self.seen, self.seen.new_zeros(length - self.seen.shape[0])])
        if self.history is not None and self.history.shape[1] < length:
            pad = self.history.new_zeros(self.history.shape[0], length - self.history.shape[1])
            self.history = torch.cat([self.history, pad], dim=1)

    def compact(self, keep: torch.Tensor) -> None:
        self.scores = self.scores[keep]
        self.seen = self.seen[keep] if self.seen.shape[0] else self.seen
        if self.history is not None:
            self.history = self.history[:, keep]


@dataclass(frozen=True)
class SequenceView:
    """What a policy sees of one sequence."""

    cache_len: int  # rows it occupies in the cache
    num_computed_tokens: int  # tokens it has seen (cached or evicted)
    prompt_len: int
    state: PolicyState


@dataclass
class KVPolicy:
    """Base policy: keep everything. budget: tokens kept (int) or a fraction of the tokens seen (float < 1).

    slack: tokens the cache may grow past the budget before it is compacted (amortizes the copy).
    """

    name: ClassVar[str] = "full"
    registry: ClassVar[dict[str, type[KVPolicy]]] = {}
    needs_attention: ClassVar[bool] = False
    rope_by_cache_index: ClassVar[bool] = False  # True: RoPE positions are cache indices (unbounded context)

    budget: int | float | None = None
    slack: int = 16

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        KVPolicy.registry[cls.name] = cls

    def __post_init__(self):
        b = self.budget
        ok = b is None or (isinstance(b, int) and not isinstance(b, bool) and b >= 1) or (isinstance(b, float) and 0 < b <= 1)
        if not ok:
            raise ConfigError(f"{self.name}: budget must be a token count >= 1 or a fraction in (0, 1], got {b!r}")
        if not isinstance(self.slack, int) or self.slack < 0:
            raise ConfigError(f"{self.name}: slack must be an integer >= 0, got {self.slack!r}")

    @property
    def evicts(self) -> bool:
        return self.budget is not None

    @property
    def unbounded_context(self) -> bool:
        """Sequences may run past the model's context: the cache is bounded and RoPE positions are cache indices."""
        return self.evicts and self.rope_by_cache_index

    def budget_for(self, num_tokens: int) -> int:
        """Tokens to keep for a sequence that has seen num_tokens."""
        if isinstance(self.budget, float):
            return max(1, int(self.budget * num_tokens))
        return int(self.budget)

    def attention_rows(self, seq: SequenceView, num_new: int) -> int:
        """How many of this step's query rows (the last ones) the policy wants attention for."""
        return num_new if self.needs_attention else 0

    def observe(self, state: PolicyState, attn: torch.Tensor) -> None:
        """attn: [rows, cache_len] attention of this step's last rows, each row summing to 1."""

    def should_compact(self, seq: SequenceView) -> bool:
        if not self.evicts:
            return False
        return seq.cache_len > self.budget_for(seq.num_computed_tokens) + self.slack

    def keep(self, seq: SequenceView) -> torch.Tensor | None:
        """Sorted cache indices to keep, or None to keep everything."""
        if not self.should_compact(seq):
            return None
        return self.select(seq.cache_len, self.budget_for(seq.num_computed_tokens), seq.state)

    def select(self, length: int, budget: int, state: PolicyState) -> torch.Tensor:
        return torch.arange(length)


class FullPolicy(KVPolicy):
    """No eviction: every token stays in the cache (the default)."""

    name = "full"

    def __post_init__(self):
        self.budget = None
        super().__post_init__()


def recent(length: int, n: int) -> torch.Tensor:
    return torch.arange(max(0, length - n), length)


def top_with_recent(scores: torch.Tensor, budget: int, num_recent: int, sinks: int = 0) -> torch.Tensor:
    """The num_recent last indices, the first `sinks`, and the highest-scoring others, budget in all, sorted."""
    length = scores.shape[0]
    if budget >= length:
        return torch.arange(length)
    num_recent = min(num_recent, budget)
    older = length - num_recent
    if sinks:
        scores = scores.clone()
        scores[: min(sinks, older)] = float("inf")
    heavy = torch.topk(scores[:older], budget - num_recent).indices if budget > num_recent else scores.new_zeros(0).long()
    return torch.sort(torch.cat([heavy, recent(length, num_recent)])).values


def build_policy(name: str | None, options: dict | None = None) -> KVPolicy:
    """The policy called `name` with its options; None = `full` (sliding-window layers bound themselves: their
    KV group frees what falls behind the window)."""
    options = dict(options or {})
    name = name or "full"
    cls = KVPolicy.registry.get(name)
    if cls is None:
        raise ConfigError(f"unknown kv_policy {name!r}; allowed: {', '.join(sorted(KVPolicy.registry))}")
    try:
        policy = cls(**options)
    except TypeError as e:
        raise ConfigError(f"kv_policy {name!r} does not take options {sorted(options)}: {e}") from None
    if name != "full" and policy.budget is None:
        raise ConfigError(f"kv_policy {name!r} needs a budget (kv_policy_options={{'budget': N}} or a fraction)")
    return policy


def check_policy_groups(policy: KVPolicy, groups) -> None:
    """Evicting policies act on full-attention KV groups only; refuse them where there are none, and refuse
    `streaming` (RoPE by cache index) beside sliding groups, which keep keys at their logical positions."""
    if not policy.evicts:
        return
    if all(g.sliding for g in groups):
        raise ConfigError(f"kv_policy {policy.name!r}: every layer of this model has a sliding window, which already "
                          "bounds its cache; use kv_policy='full' (the default)")
    if policy.rope_by_cache_index and any(g.sliding for g in groups):
        raise ConfigError(f"kv_policy {policy.name!r} positions keys by cache index, which sliding-window layers do not; "
                          "allowed on this model: full, window, h2o, scissorhands, snapkv")
