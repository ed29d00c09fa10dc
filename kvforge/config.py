"""EngineConfig: every engine option in one dataclass, validated in __post_init__."""
from __future__ import annotations

import os
from dataclasses import dataclass

from kvforge.errors import ConfigError
from kvforge.kv.tiers.parse import TierSpec, parse_tiers
from kvforge.speculative_config import SpeculativeConfig
from kvforge.units import parse_size

KV_LAYOUTS = ("paged", "contiguous")
PREEMPTION_MODES = (None, "recompute", "swap")
WEIGHT_KINDS = ("auto", "fp32", "int8", "q8_0", "q4_0")
PREFILL_ORDERS = ("shortest", "fcfs")


@dataclass
class EngineConfig:
    model: str | None = None  # GGUF file or Hugging Face dir; None = embedded SmolLM2-135M-Instruct
    kv_cache_memory: int | str | None = None  # KV budget: bytes or a size string ("512MiB"); None = the fraction below
    kv_cache_memory_fraction: float = 0.1  # of free memory, when kv_cache_memory is None (CLI --gpu-memory-utilization)
    kv_cache_dtype: str = "fp32"
    kv_cache_options: dict | None = None  # format options, e.g. {"group_size": 32}
    block_size: int = 16
    kv_layout: str = "paged"
    max_num_seqs: int = 64
    # the largest share of the KV budget that staged formats' per-sequence fp16 windows and sinks may take: fewer
    # sequences run at once when max_num_seqs' would take more (1.0: staging for max_num_seqs whatever it costs)
    kv_staging_share: float = 0.25
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None = the model's context length
    enable_chunked_prefill: bool = True
    # the order waiting requests start in: "fcfs" (arrival order, vLLM's and SGLang's default) or "shortest" (fewest
    # uncached prompt tokens first, in groups sized to a step's cost, a request overtaken by more than
    # prefill_overtake_tokens goes first: engine/prefill_order.py); prefill_token_cost: a prefill token's share of a
    # step's fixed cost, which sizes the groups
    prefill_order: str = "fcfs"
    prefill_token_cost: float = 0.05
    prefill_overtake_tokens: int = 8192
    enable_prefix_caching: bool = True
    # full | window | streaming | h2o | scissorhands | snapkv | tova | keydiff | expected_attention | kvzip; None = full
    kv_policy: str | None = None
    kv_cache_groups: bool = True  # sliding-window layers in their own KV groups (False: every layer keeps its history)
    kv_policy_options: dict | None = None  # e.g. {"budget": 1024, "sinks": 4}; budget < 1.0 = fraction of the length
    # e.g. {"method": "ngram", "num_speculative_tokens": 5}, a SpeculativeConfig after __post_init__; None = off
    speculative: SpeculativeConfig | dict | None = None
    device: str | None = None  # None = cuda when available, else cpu
    seed: int | None = None  # seeds unseeded requests reproducibly; None = fresh randomness every run
    # tiers below the pool, lookup order: "host:8GiB", "disk:PATH:100GiB", "redis://HOST:PORT"; parsed into TierSpecs
    kv_tiers: list[str | TierSpec] | None = None
    preemption_mode: str | None = None  # "recompute" | "swap"; None = swap when a KV policy evicts and a host tier exists
    # True: every tier gets a block when it is cached; False: a tier gets what leaves the pool (or the tier above);
    # None: write-through for disk and Redis (other processes reuse blocks at once), write-back for host
    kv_tier_write_through: bool | None = None
    kv_tier_fsync: bool = True  # disk tier: fsync each block file before its rename, and the directory after
    # "auto": as stored (a GGUF's Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 tensors stay in their blocks, computed in place; other
    # tensors and fp32 checkpoints fp32); "fp32": every tensor dequantized at load; "int8": weight-only int8 linear
    # layers (per-output-channel scales), fp32 activations; "q8_0": an fp32 model's linear weights and embedding
    # quantized at load into GGUF Q8_0 blocks, computed in place as "auto" computes a Q8_0 file; "q4_0": the same with
    # Q4_0 blocks for the layers (the embedding and LM head Q8_0)
    weights: str = "auto"
    # recurrent models with prefix caching: bytes (or a size) of the KV budget that holds state checkpoints (None:
    # one eighth of it), and every how many blocks of a prompt one is taken (plus its last whole block)
    state_checkpoint_memory: int | str | None = None
    state_checkpoint_interval: int = 1

    def __post_init__(self):
        if isinstance(self.kv_cache_memory, str):
            self.kv_cache_memory = parse_size(self.kv_cache_memory)
        if isinstance(self.state_checkpoint_memory, str):
            self.state_checkpoint_memory = parse_size(self.state_checkpoint_memory)
        checks = [
            (self.state_checkpoint_memory is None or (isinstance(self.state_checkpoint_memory, int)
                                                      and self.state_checkpoint_memory >= 0),
             f"state_checkpoint_memory must be a number of bytes >= 0 or None, got {self.state_checkpoint_memory!r}"),
            (isinstance(self.state_checkpoint_interval, int) and self.state_checkpoint_interval >= 1,
             f"state_checkpoint_interval must be an integer >= 1 (blocks), got {self.state_checkpoint_interval!r}"),
            (self.block_size in (1, 2, 4, 8, 16, 32, 64, 128, 256), f"block_size must be a power of two in 1..256, got {self.block_size!r}"),
            (self.kv_layout in KV_LAYOUTS, f"kv_layout must be one of {KV_LAYOUTS}, got {self.kv_layout!r}"),
            (isinstance(self.max_num_seqs, int) and self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs!r}"),
            (isinstance(self.max_num_batched_tokens, int) and self.max_num_batched_tokens >= 1,
             f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens!r}"),
            (self.max_model_len is None or (isinstance(self.max_model_len, int) and self.max_model_len >= 1),
             f"max_model_len must be a positive integer or None, got {self.max_model_len!r}"),
            (self.kv_cache_memory is None or (isinstance(self.kv_cache_memory, int) and self.kv_cache_memory > 0),
             f"kv_cache_memory must be a positive number of bytes or None, got {self.kv_cache_memory!r}"),
            (self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)
                                   and -(2**63) <= self.seed < 2**64),
             f"seed must be None or an integer in [-2**63, 2**64 - 1], got {self.seed!r}"),
            (0 < self.kv_cache_memory_fraction <= 0.95, f"kv_cache_memory_fraction must be in (0, 0.95], got {self.kv_cache_memory_fraction!r}"),
            (isinstance(self.kv_staging_share, (int, float)) and 0 < self.kv_staging_share <= 1,
             f"kv_staging_share must be in (0, 1], got {self.kv_staging_share!r}"),
            (self.weights in WEIGHT_KINDS, f"weights must be one of {WEIGHT_KINDS}, got {self.weights!r}"),
            (self.prefill_order in PREFILL_ORDERS, f"prefill_order must be one of {PREFILL_ORDERS}, got {self.prefill_order!r}"),
            (isinstance(self.prefill_token_cost, (int, float)) and self.prefill_token_cost > 0,
             f"prefill_token_cost must be a number > 0 (a step's fixed cost is 1), got {self.prefill_token_cost!r}"),
            (isinstance(self.prefill_overtake_tokens, int) and self.prefill_overtake_tokens >= 0,
             f"prefill_overtake_tokens must be an integer >= 0, got {self.prefill_overtake_tokens!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        self._check_tiers()
        self._check_preemption()
        if not self.enable_chunked_prefill and self.max_model_len and self.max_model_len > self.max_num_batched_tokens:
            raise ConfigError("without chunked prefill, max_num_batched_tokens must be >= max_model_len "
                              f"({self.max_num_batched_tokens} < {self.max_model_len})")
        if self.model is not None:
            self.model = os.fspath(self.model)
        self.speculative = SpeculativeConfig.parse(self.speculative)

    def _check_tiers(self) -> None:
        self.kv_tiers = parse_tiers(self.kv_tiers)
        if not isinstance(self.kv_tier_fsync, bool):
            raise ConfigError(f"kv_tier_fsync must be True or False, got {self.kv_tier_fsync!r}")
        if self.kv_tier_write_through is not None and not isinstance(self.kv_tier_write_through, bool):
            raise ConfigError("kv_tier_write_through must be True, False or None (write-through for disk and Redis, "
                              f"write-back for host), got {self.kv_tier_write_through!r}")

    def _check_preemption(self) -> None:
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ConfigError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if self.preemption_mode == "swap" and self.kv_layout != "paged":
            raise ConfigError("preemption_mode='swap' needs kv_layout='paged'")
        if self.preemption_mode == "swap" and not self.kv_tiers:
            raise ConfigError("preemption_mode='swap' needs a KV tier to swap to, e.g. kv_tiers=['host:4GiB']")

    def resolve_preemption_mode(self, policy_evicts: bool) -> str:
        """The mode as given; by default swap when the KV policy evicts (recompute cannot rebuild a compacted cache)
        and a host tier exists, else recompute."""
        if self.preemption_mode is not None:
            return self.preemption_mode
        host = any(t.kind == "host" for t in self.kv_tiers or [])
        return "swap" if policy_evicts and host else "recompute"

    def resolve_device(self):
        import torch

        if self.device is None:
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            device = torch.device(self.device)
        except RuntimeError as e:
            raise ConfigError(f"device {self.device!r} is not a torch device (e.g. 'cpu', 'cuda', 'cuda:0'): {e}") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device {self.device!r}: this torch ({torch.__version__}) has no usable CUDA device; "
                              "use device 'cpu' (or leave it unset), or install a CUDA build of torch")
        if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"device {self.device!r}: only {torch.cuda.device_count()} CUDA device(s), "
                              f"cuda:0..cuda:{torch.cuda.device_count() - 1}")
        if device.type not in ("cpu", "cuda"):
            raise ConfigError(f"device {self.device!r}: kvforge runs on 'cpu' or 'cuda' devices")
        return device


def check_max_model_len(max_model_len: int, context: int, policy) -> None:
    """Refuse a max_model_len beyond the model's context unless the KV policy keeps RoPE positions bounded."""
    if max_model_len <= context or policy.unbounded_context:
        return
    raise ConfigError(
        f"max_model_len={max_model_len} is more than the model's context of {context} tokens (max_position_embeddings); "
        f"use max_model_len <= {context}, or kv_policy='streaming' (StreamingLLM keeps positions inside the context)")
