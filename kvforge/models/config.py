"""ModelConfig: the architecture facts the engine needs, whatever file they came from."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvforge.errors import ModelLoadError
from kvforge.kv.groups import StateGroup
from kvforge.kv.spec import KVCacheSpec

FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass
class ModelConfig:
    arch: str  # "llama" (Llama, Mistral, SmolLM), "qwen2", "qwen3", "gemma2", "gemma3", "deepseek_v2", "deepseek_v3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # RMSNorm on q and k per head before RoPE (Qwen3)
    sliding_window: int | None = None
    layer_types: list[str] | None = None  # per layer "full_attention" | "sliding_attention"; None = all alike
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # architecture-specific (MLA, MoE, Mamba-2)
    # recurrent hybrids: model layers with attention (KV layer i is model layer attention_layers[i]; None = every
    # layer) and the recurrent layers' state groups (kv/groups.py StateGroup)
    attention_layers: list[int] | None = None
    state_groups: list[StateGroup] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.layer_types is not None:
            bad = sorted({t for t in self.layer_types if t not in (FULL, SLIDING)})
            if len(self.layer_types) != self.num_layers or bad:
                raise ModelLoadError(
                    f"layer_types must list one of {FULL!r}, {SLIDING!r} for each of the {self.num_layers} layers; "
                    f"got {len(self.layer_types)} entries" + (f" including {bad}" if bad else ""))
            if SLIDING in self.layer_types and not self.sliding_window:
                raise ModelLoadError("layer_types has sliding_attention layers but no sliding_window is set")

    def layer_window(self, layer: int) -> int | None:
        """The sliding window layer `layer` attends within; None for full attention."""
        return self.layer_windows()[layer]

    @property
    def num_kv_layers(self) -> int:
        """Layers that cache K/V (a hybrid's attention layers)."""
        return self.num_layers if self.attention_layers is None else len(self.attention_layers)

    @property
    def recurrent(self) -> bool:
        return bool(self.state_groups)

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def kv_cache_spec(self) -> KVCacheSpec:
        """What one token caches per layer: K/V rows per KV head, or MLA's latent row (c_kv + rotary key)."""
        kv_lora_rank = self.extra.get("kv_lora_rank")
        if kv_lora_rank:
            return KVCacheSpec(self.num_layers, 1, kv_lora_rank + self.extra["qk_rope_head_dim"], 0)
        return KVCacheSpec(self.num_kv_layers, self.num_kv_heads, self.head_dim, self.head_dim)

    def layer_windows(self) -> list[int | None]:
        """Each layer's sliding window in tokens (None = full attention), as transformers applies them: with a
        `sliding_window`, the layers `layer_types` marks sliding (every layer when there is no list)."""
        if not self.sliding_window:
            return [None] * self.num_kv_layers
        if self.layer_types is None:
            return [self.sliding_window] * self.num_layers
        return [self.sliding_window if t == SLIDING else None for t in self.layer_types]

    @property
    def attention_kind(self) -> str:
        if self.num_kv_layers == 0:
            return "none"
        if self.extra.get("kv_lora_rank"):
            return "MLA"
        if self.num_kv_heads == self.num_heads:
            return "MHA"
        if self.num_kv_heads == 1:
            return "MQA"
        return "GQA"
