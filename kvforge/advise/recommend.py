"""A recommended engine configuration: as EngineConfig kwargs, as CLI flags, and what it costs in memory."""
from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass
from typing import Any

from kvforge.kv.formats import get_format
from kvforge.kv.memory import blocks_for_tokens, bytes_for_sequence, bytes_per_token
from kvforge.memcalc import ResolvedModel, what_fits


@dataclass
class Recommendation:
    kv_cache_dtype: str = "fp32"
    kv_layout: str = "paged"
    enable_prefix_caching: bool = True
    kv_policy: str | None = None
    kv_policy_options: dict | None = None
    block_size: int = 16

    @property
    def label(self) -> str:
        policy = f"+{self.kv_policy}:{self.kv_policy_options['budget']}" if self.kv_policy else ""
        return f"{self.kv_cache_dtype}{policy}"

    @property
    def cached_tokens_cap(self) -> int | None:
        """Tokens a sequence keeps at most (the policy's budget), None when the cache keeps all."""
        return self.kv_policy_options["budget"] if self.kv_policy else None

    def engine_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {"kv_cache_dtype": self.kv_cache_dtype, "kv_layout": self.kv_layout,
                              "enable_prefix_caching": self.enable_prefix_caching}
        if self.block_size != 16:
            kw["block_size"] = self.block_size
        if self.kv_policy:
            kw["kv_policy"], kw["kv_policy_options"] = self.kv_policy, dict(self.kv_policy_options or {})
        return kw

    def cli_flags(self) -> str:
        flags = ["--kv-dtype", self.kv_cache_dtype, "--kv-layout", self.kv_layout]
        if self.block_size != 16:
            flags += ["--block-size", str(self.block_size)]
        if not self.enable_prefix_caching:
            flags.append("--no-prefix-caching")
        if self.kv_policy:
            options = dict(self.kv_policy_options or {})
            flags += ["--kv-policy", self.kv_policy, "--budget", str(options.pop("budget"))]
            if options:
                flags += ["--kv-policy-options", json.dumps(options)]
        return shlex.join(flags)

    def python(self, model: str | None = None) -> str:
        args = ([f"model={model!r}"] if model else []) + [f"{k}={v!r}" for k, v in self.engine_kwargs().items()]
        return f"LLM({', '.join(args)})"

    def to_dict(self, model: str | None = None) -> dict[str, Any]:
        return {**asdict(self), "label": self.label, "engine_kwargs": self.engine_kwargs(),
                "cli_flags": self.cli_flags(), "python": self.python(model)}


@dataclass
class MemoryLine:
    """One configuration's KV cost for the workload, from the engine's own formula (kvforge.kv.memory)."""

    label: str
    kv_dtype: str
    bytes_per_token: float
    cached_tokens: int  # per sequence
    bytes_per_sequence: int
    max_batch: int | None = None  # sequences of cached_tokens that fit in --memory (after weights)


@dataclass
class MemoryConsequence:
    context: int  # tokens per sequence the figures assume (the model's context when unbounded)
    weights_bytes: int | None
    kv_budget_bytes: int | None
    lines: list[MemoryLine]

    @property
    def saving(self) -> float:
        """Bytes per sequence: the default fp32 full cache over the recommendation."""
        return self.lines[0].bytes_per_sequence / self.lines[-1].bytes_per_sequence

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "saving": self.saving}


def memory_line(m: ResolvedModel, label: str, kv_dtype: str, tokens: int, block_size: int,
                memory: int | None, weights: int) -> MemoryLine:
    spec, fmt = m.config.kv_cache_spec(), get_format(kv_dtype)
    line = MemoryLine(label, kv_dtype, bytes_per_token(spec, fmt, block_size), tokens,
                      bytes_for_sequence(spec, fmt, tokens, block_size))
    if memory is not None:
        line.max_batch = what_fits(spec, fmt, block_size, memory, weights, tokens, 1).max_batch
    return line


def fits(m: ResolvedModel, kv_dtype: str, tokens: int, batch: int, block_size: int, memory: int | None,
         weights: int) -> bool:
    if memory is None:
        return True
    spec, fmt = m.config.kv_cache_spec(), get_format(kv_dtype)
    blocks = what_fits(spec, fmt, block_size, memory, weights, tokens, batch).num_blocks
    return blocks >= batch * blocks_for_tokens(tokens, block_size)


def tokens_that_fit(m: ResolvedModel, kv_dtype: str, batch: int, block_size: int, memory: int, weights: int) -> int:
    """Cached tokens per sequence when `batch` sequences share what is left of memory."""
    spec, fmt = m.config.kv_cache_spec(), get_format(kv_dtype)
    return what_fits(spec, fmt, block_size, memory, weights, block_size, batch).max_seq_len
