"""KVzip: keep the cached pairs the model needs to repeat its context (query-agnostic, once per prompt)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvforge.errors import ConfigError
from kvforge.kv.policies.base import KVPolicy, PolicyState, SequenceView, top_with_recent


@dataclass
class KVzipPolicy(KVPolicy):
    """KVzip (Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction", 2025,
    arXiv:2505.23416; kvpress's KVzipPress). When a prompt's prefill completes, the model is asked to repeat it:
    a scoring pass feeds `repeat_prompt` and then the prompt's own tokens after the cached context, `chunk` of them
    per forward (the paper's chunked scoring: each forward's rows are dropped before the next), and each cached pair
    scores the largest attention it receives from those queries (max over the queries and over the query heads of
    its KV head; kvforge.engine.reconstruction). The top `budget` (a fraction of the prompt, or a count) stay per layer and KV head, the scoring
    pass's own K/V rows are discarded and its blocks freed. Generated tokens are all kept (the prompt is compressed
    once, as SnapKV), and decode records no attention, so it stays on the compiled operator.

    repeat_prompt: the instruction before the repeated context, text (encoded with the model's tokenizer) or token
        ids (the paper: "Repeat the previous context exactly.", in the model's chat template).
    chunk: context tokens repeated per forward of the scoring pass (memory: len(repeat) + chunk rows beside the cache).
    sinks: the first tokens, always kept. scope: "head" (each layer and KV head keeps its own pairs, the paper) or
        "layer" (scores summed over the KV heads).
    reuse: keep each compressed prompt for later requests whose prompt starts with it (one context, many
        questions: kvforge.kv.compressed_prefixes); the kept count is rounded up to whole blocks so they can be shared.
    """

    name = "kvzip"
    default_budget = 0.5  # when no budget is given
    needs_attention = True
    max_over_queries = True
    reconstructs = True
    scopes = ("layer", "head")
    repeat_prompt: str | list[int] = "\n\nRepeat the previous context exactly."
    chunk: int = 512
    sinks: int = 4
    scope: str = "head"
    reuse: bool = False

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.repeat_prompt, (str, list, tuple)):
            raise ConfigError(f"kvzip: repeat_prompt must be text or a list of token ids, got {self.repeat_prompt!r}")
        if not isinstance(self.chunk, int) or isinstance(self.chunk, bool) or self.chunk < 1:
            raise ConfigError(f"kvzip: chunk must be an integer >= 1, got {self.chunk!r}")
        if not isinstance(self.sinks, int) or self.sinks < 0:
            raise ConfigError(f"kvzip: sinks must be an integer >= 0, got {self.sinks!r}")
        if not isinstance(self.reuse, bool):
            raise ConfigError(f"kvzip: reuse must be true or false, got {self.reuse!r}")

    @property
    def reuses_prefixes(self) -> bool:
        return self.reuse

    @property
    def query_heads(self) -> str:
        return "max"

    def repeat_ids(self, encode) -> list[int]:
        """The instruction's token ids (text needs the model's tokenizer: `encode`)."""
        if not isinstance(self.repeat_prompt, str):
            return [int(t) for t in self.repeat_prompt]
        if encode is None:
            raise ConfigError("kvzip: repeat_prompt is text and this engine has no tokenizer; give token ids instead")
        return list(encode(self.repeat_prompt))

    def wants_scoring(self, seq: SequenceView) -> bool:
        """The prompt's prefill has completed and its scoring pass has not run."""
        state = seq.state
        return not state.pending and not state.selected and seq.num_computed_tokens >= seq.prompt_len

    def attention_rows(self, seq: SequenceView, num_new: int) -> int:
        return num_new if seq.state.pending and not seq.state.selected else 0  # the scoring pass only

    def observe(self, state: PolicyState, attn: torch.Tensor, queries: int | None = None) -> None:
        """attn: [layers, heads or 1, 1, cache_len], each pair's max attention over the scoring pass."""
        state.scores = attn[:, :, 0]
        state.selected = True  # scored; state.pending stays set until keep() compresses

    def should_compact(self, seq: SequenceView) -> bool:
        return seq.state.pending and seq.state.selected

    def keep(self, seq: SequenceView, drop_unit: int = 1) -> torch.Tensor | None:  # one compression: kept as is
        if not self.should_compact(seq):
            return None
        seq.state.pending = False
        budget = self.budget_for(seq.num_computed_tokens)
        if budget >= seq.cache_len:
            return None
        return self.select(seq.cache_len, budget, seq.state)

    def select(self, length: int, budget: int, state: PolicyState) -> torch.Tensor:
        return top_with_recent(state.scores[..., :length], budget, 0, min(self.sinks, budget))
