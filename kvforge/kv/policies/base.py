"""KVPolicy: which cached tokens of a sequence to keep (the protocol every eviction policy follows).

A policy sees the attention rows of the tokens the step just computed (when it asks for them) and answers
the cache indices to keep. Scope "sequence": one kept set shared by every layer and KV head (statistics
summed over both), indices [m]. Scope "layer" / "head" (h2o, scissorhands): each full-attention layer (and
KV head) keeps its own top rows, indices [layers, heads or 1, m]; every layer keeps the same number, so a
sequence still has one block table and one cache length (keys are stored after RoPE, so a row may hold a
different token in each layer and head).
"""
from __future__ import annotations

import difflib
import json
from dataclasses import asdict, dataclass, field, fields
from typing import ClassVar

import torch

from kvforge.errors import ConfigError
from kvforge.kv.policies.head_roles import check_heads_option


@dataclass
class PolicyState:
    """Per-sequence statistics, indexed by cache index along the last axis."""

    scores: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    seen: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # queries that could attend to each (h2o mean)
    history: torch.Tensor | None = None  # [rows, cache_len] per-query importance (scissorhands)
    values: torch.Tensor | None = None  # [layers, heads, cache_len] value-row L1 norms (value-weighted scores)
    pending: bool = False  # snapkv: votes are in, the prompt is compressed at the next keep()
    selected: bool = False  # snapkv: the prompt was compressed
    keys: torch.Tensor | None = None  # [layers, heads, cache_len, dim] cached keys, read just before a compaction (keydiff)
    queries: torch.Tensor | None = None  # [layers, query heads, window, dim] recent queries (expected_attention)
    query_positions: torch.Tensor | None = None  # [window] their RoPE positions
    inv_freq: torch.Tensor | None = None  # the model's RoPE frequencies, with the queries
    positions: torch.Tensor | None = None  # [layers, heads, n] logical position of each of the first n rows

    def grow(self, length: int, lead: tuple[int, ...] = ()) -> None:
        """Pad every statistic to `length` cache indices; `lead` (layers, heads) shapes new per-layer ones."""
        if lead and self.scores.dim() == 1 and self.scores.shape[0] == 0:
            self.scores, self.seen = torch.zeros(*lead, 0), torch.zeros(*lead, 0)
        self.scores, self.seen = _pad_last(self.scores, length), _pad_last(self.seen, length)
        if self.history is not None:
            self.history = _pad_last(self.history, length)

    def compact(self, keep: torch.Tensor) -> None:
        """Keep cache indices `keep`: [m] for every layer, or [layers, heads or 1, m] per layer (and head)."""
        self.scores = _take_last(self.scores, keep)
        self.seen = _take_last(self.seen, keep) if self.seen.shape[-1] else self.seen
        if self.history is not None:
            self.history = _take_last(self.history, keep)
        if self.values is not None:
            self.values = _take_last(self.values, keep)
        if self.positions is not None:
            self.positions = _take_last(self.positions, keep)
        self.keys = None  # read again at the next compaction

    def values_known(self, length: int) -> int:
        """Leading cache indices (of `length`) whose value norms are recorded."""
        return 0 if self.values is None else min(self.values.shape[-1], length)

    def set_values(self, start: int, norms: torch.Tensor) -> None:
        """Value norms [layers, heads, n] of cache indices start..start+n-1 (rows just written or rewritten);
        norms recorded past them are dropped (rows rolled back)."""
        kept = self.values[..., :start] if self.values is not None else norms[..., :0]
        self.values = torch.cat([kept, norms], dim=-1)


def _pad_last(x: torch.Tensor, length: int) -> torch.Tensor:
    if x.shape[-1] >= length:
        return x
    return torch.cat([x, x.new_zeros(*x.shape[:-1], length - x.shape[-1])], dim=-1)


def _take_last(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    if keep.dim() == 1:
        return x[..., keep]
    if x.dim() < keep.dim():  # a statistic the policy keeps per sequence, taken per layer and head
        x = x.expand(*keep.shape[:-1], x.shape[-1])
    return x.gather(-1, keep.to(x.device).expand(*x.shape[:-1], keep.shape[-1]))


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
    sums_queries: ClassVar[bool] = False  # observe only needs attention summed over queries (per-layer stats sum early)
    max_over_queries: ClassVar[bool] = False  # observe gets each key's max over the asked queries (kvzip)
    reconstructs: ClassVar[bool] = False  # runs a scoring pass of its own at the end of the prompt (kvzip)
    scopes: ClassVar[tuple[str, ...]] = ("sequence",)  # what may keep its own rows: sequence, layer, head
    rope_by_cache_index: ClassVar[bool] = False  # True: RoPE positions are cache indices (unbounded context)
    default_budget: ClassVar[int | float | None] = None  # what build_policy gives when no budget is set

    budget: int | float | None = None
    slack: int = 16
    heads: str | None = None  # per-head roles: "auto" or a `kvforge calibrate heads` file (scope "head"; head_roles.py)
    retrieval_heads: float = 0.25  # with heads: the share of heads with the highest retrieval scores
    streaming_heads: float = 0.5  # with heads: the share with the lowest, which keep sinks + their newest rows

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
        if self.scope not in self.scopes:
            raise ConfigError(f"{self.name}: scope must be one of {', '.join(self.scopes)}, got {self.scope!r}")
        check_heads_option(self.name, self.heads, self.retrieval_heads, self.streaming_heads)
        if self.heads is not None and self.scope != "head":
            raise ConfigError(f"{self.name}: heads (per-head roles) needs scope 'head' (each layer and KV head keeps "
                              f"its own rows), got scope {self.scope!r}; policies with it: h2o, scissorhands, keydiff, "
                              "expected_attention, kvzip")

    @property
    def scope(self) -> str:
        """sequence: one kept set for all layers and heads; layer: one per layer; head: one per layer and KV head."""
        return "sequence"

    @property
    def weighs_values(self) -> bool:
        """The policy's scores need value-row norms (the Evictor records them in PolicyState.values)."""
        return False

    @property
    def needs_queries(self) -> bool:
        """observe_queries gets the asked rows' queries (after RoPE) per layer, with their positions."""
        return False

    @property
    def reads_keys(self) -> bool:
        """select needs the cached keys (the Evictor reads them into PolicyState.keys when a compaction is due)."""
        return False

    @property
    def query_heads(self) -> str:
        """How the attention of the query heads sharing a KV head combines before the policy sees it: sum or max."""
        return "sum"

    @property
    def places_in_place(self) -> bool:
        """Kept rows may stay at their cache index (placement.in_place): the policy tells age by
        PolicyState.positions, not by cache index."""
        return False

    @property
    def reuses_prefixes(self) -> bool:
        """Compressed prompts are kept for later prompts that start with them (kvzip's `reuse`)."""
        return False

    def namespace(self) -> str:
        """What names this policy's compressed rows: the method and every option (budget included)."""
        return f"{self.name}:" + json.dumps(asdict(self), sort_keys=True, default=str)

    @property
    def per_layer(self) -> bool:
        return self.scope != "sequence"

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

    def observe(self, state: PolicyState, attn: torch.Tensor, queries: int | None = None) -> None:
        """attn: [rows, cache_len] attention of this step's last rows, each row summing to 1; per-layer scopes
        get [layers, heads or 1, rows, cache_len]. queries: the step's queries those rows stand for (more than
        rows when, for a policy that `sums_queries`, the first row is the sum of several; default rows)."""

    def should_compact(self, seq: SequenceView) -> bool:
        if not self.evicts:
            return False
        return seq.cache_len > self.budget_for(seq.num_computed_tokens) + self.slack

    def keep(self, seq: SequenceView, drop_unit: int = 1) -> torch.Tensor | None:
        """Sorted cache indices to keep, or None to keep everything. With drop_unit > 1 (the Evictor passes its
        format's: the block size for per-channel keys) the rows dropped are the largest multiple of it that leaves
        at most budget + slack rows, so the rows behind the last dropped one shift by whole blocks (and move as
        stored); up to drop_unit - 1 rows then stay over the budget until the next compaction."""
        if not self.should_compact(seq):
            return None
        budget, length = self.budget_for(seq.num_computed_tokens), seq.cache_len
        drop = (length - budget) // drop_unit * drop_unit
        if drop == 0 or length - drop > budget + self.slack:
            drop = length - budget
        return self.select(length, length - drop, seq.state)

    def select(self, length: int, budget: int, state: PolicyState) -> torch.Tensor:
        return torch.arange(length)


class FullPolicy(KVPolicy):
    """No eviction: every token stays in the cache (the default)."""

    name = "full"

    def __post_init__(self):
        self.budget = None
        super().__post_init__()


WEIGHTS = ("attention", "value")
QUERY_HEADS = ("sum", "max")


def check_query_heads(policy: KVPolicy, query_heads: str) -> None:
    if query_heads not in QUERY_HEADS:
        raise ConfigError(f"{policy.name}: query_heads must be one of {', '.join(QUERY_HEADS)}, got {query_heads!r}")


def check_weight(policy: KVPolicy, weight: str) -> None:
    """weight "value" (attention x value-row norm) needs each KV head's own scores: scope "head"."""
    if weight not in WEIGHTS:
        raise ConfigError(f"{policy.name}: weight must be one of {', '.join(WEIGHTS)}, got {weight!r}")
    if weight == "value" and policy.scope != "head":
        raise ConfigError(f"{policy.name}: weight 'value' needs scope 'head' (each KV head weighs by its own value "
                          f"rows), got scope {policy.scope!r}")


def recent(length: int, n: int) -> torch.Tensor:
    return torch.arange(max(0, length - n), length)


def top_with_recent(scores: torch.Tensor, budget: int, num_recent: int, sinks: int = 0) -> torch.Tensor:
    """The num_recent last indices, the first `sinks`, and the highest-scoring others, budget in all, sorted.
    scores: [length], or [..., length] for a kept set per leading index (then [..., budget])."""
    length = scores.shape[-1]
    if budget >= length:
        return torch.arange(length)
    num_recent = min(num_recent, budget)
    older = length - num_recent
    if sinks:
        scores = scores.clone()
        scores[..., : min(sinks, older)] = float("inf")
    lead = scores.shape[:-1]
    heavy = (torch.topk(scores[..., :older], budget - num_recent, dim=-1).indices if budget > num_recent
             else torch.zeros(*lead, 0, dtype=torch.long))
    return torch.sort(torch.cat([heavy, recent(length, num_recent).expand(*lead, -1)], dim=-1), dim=-1).values


def build_policy(name: str | None, options: dict | None = None) -> KVPolicy:
    """The policy called `name` with its options; None = `full` (sliding-window layers bound themselves: their
    KV group frees what falls behind the window)."""
    options = dict(options or {})
    name = name or "full"
    cls = KVPolicy.registry.get(name)
    if cls is None:
        raise ConfigError(f"unknown kv_policy {name!r}; allowed: {', '.join(sorted(KVPolicy.registry))}")
    check_option_names(cls, options)
    if options.get("budget") is None and cls.default_budget is not None:
        options["budget"] = cls.default_budget
    budget = options.get("budget")
    sinks = next((f.default for f in fields(cls) if f.name == "sinks"), None)
    if "sinks" not in options and isinstance(sinks, int) and isinstance(budget, int) and not isinstance(budget, bool) \
            and 1 <= budget <= sinks:
        options["sinks"] = budget - 1  # a small budget keeps room for recent tokens; sinks the user never set
    policy = cls(**options)
    if name != "full" and policy.budget is None:
        raise ConfigError(f"kv_policy {name!r} needs a budget (kv_policy_options={{'budget': N}} or a fraction)")
    return policy


def check_option_names(cls: type[KVPolicy], options: dict) -> None:
    """Every option is one the policy takes; a misspelling is named, with the closest option and the full list."""
    known = [f.name for f in fields(cls)]
    for option in options:
        if option not in known:
            close = difflib.get_close_matches(str(option), known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"kv_policy {cls.name!r} has no option {option!r}{hint}; its options: {', '.join(known)} "
                              "(kv_policy_options in Python; --budget and --kv-policy-options JSON on the command line)")


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
                          "allowed on this model: full, window, h2o, scissorhands, snapkv, keydiff, tova")
