"""KVCacheSpec: what one token stores in the cache, per layer."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheSpec:
    """Per-layer shape of one cached token.

    Standard attention (MHA/GQA/MQA) stores a key row and a value row per KV head.
    MLA stores one latent row (compressed c_kv followed by the shared rotary key) and no value.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int

    @property
    def has_values(self) -> bool:
        return self.v_head_dim > 0

    @property
    def elements_per_token_per_layer(self) -> int:
        return self.num_kv_heads * (self.head_dim + self.v_head_dim)

    @property
    def elements_per_token(self) -> int:
        return self.num_layers * self.elements_per_token_per_layer
