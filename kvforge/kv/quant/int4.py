"""INT4 KV cache: asymmetric 4-bit groups (scale and zero per group), two codes per byte.

Defaults are tuned on SmolLM2-135M (decode-faithful perplexity, 4,096 tokens of Hamlet): keys
grouped per token like values lose 12%, because of keys' outlier channels; keys per channel
(KIVI, Liu et al. 2024) with 4 exact sink tokens lose ~0.4%. To stay >= 3.2x smaller than fp16 at
block_size 16 (per-sequence staging counted), group parameters are 8-bit and values use groups of 64.
Options:
  group_size      values (and per-token keys) per group along head_dim (default 64).
  key_axis        "channel" (default): keys per channel over a block's tokens; the block being filled
                  stays fp16 in a staging entry until its sequence's window moves past it.
                  "token": keys grouped like values; rows independent, no staging.
  scale_bits      8 (default): scales as uint8 log2 codes, per-channel zeros as uint8 codes on a
                  per-head grid (see uniform.py), per-token zeros fp16; 16: scale and zero both fp16.
  sinks           first positions of each sequence kept fp16 (default 4; needs `positions` on write).
  window          most recent tokens per sequence kept fp16 (default 16, rounded up to whole blocks: the block
                  being filled and the one before). Chosen on the evaluation panel (docs/results.md): without
                  it int4 lost 1.17% on a license text; 32 would cost the 3.2x capacity goal (3.18x).
  outlier_frac    fraction of each block's values kept fp16 (dense-and-sparse, KVQuant; default 0).
"""
from __future__ import annotations

from dataclasses import dataclass

from kvforge.errors import ConfigError
from kvforge.kv.quant.base import UniformFormat

KEY_AXES = ("token", "channel")


@dataclass
class INT4(UniformFormat):
    name = "int4"
    bits = 4
    group_size: int = 64
    key_axis: str = "channel"
    window: int = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.key_axis not in KEY_AXES:
            raise ConfigError(f"int4: key_axis must be one of {KEY_AXES}, got {self.key_axis!r}")
