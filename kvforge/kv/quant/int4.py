"""INT4 KV cache: asymmetric 4-bit groups (scale and zero per group), two codes per byte.

Defaults are tuned on SmolLM2-135M (decode-faithful perplexity, 2,048 tokens of Hamlet): keys per
token lose 6.7% (4.5% with exact sinks) because of keys' outlier channels; keys per channel
(KIVI, Liu et al. 2024) with 4 exact sink tokens lose ~0.6%. To stay >= 3.2x smaller than fp16 at
block_size 16, group scales are stored as 8-bit log2 codes and values use groups of 64.
Options:
  group_size      values (and per-token keys) per group along head_dim (default 64).
  key_axis        "channel" (default): keys per channel over a block's tokens; the block being filled
                  stays fp16 in a staging entry until newer blocks need it.
                  "token": keys grouped like values; rows independent, no staging.
  scale_bits      8 (default): each group's scale as a uint8 log2 code (rounded up), zero in fp16;
                  16: scale and zero both fp16.
  sinks           first positions of each sequence kept fp16 (default 4; needs `positions` on write).
  window          most recent tokens per sequence kept fp16 (default 0; rounded up to whole blocks).
  outlier_frac    fraction of each block's values kept fp16 (dense-and-sparse, KVQuant; default 0).
"""
from __future__ import annotations

from dataclasses import dataclass

from kvforge.errors import ConfigError
from kvforge.kv.quant.base import QuantFormat, check_frac, check_group, check_int, check_scale_bits
from kvforge.kv.quant.codec import Codec
from kvforge.kv.quant.uniform import UniformCodec
from kvforge.kv.spec import KVCacheSpec

KEY_AXES = ("token", "channel")


@dataclass
class INT4(QuantFormat):
    name = "int4"
    group_size: int = 64
    key_axis: str = "channel"
    scale_bits: int = 8
    sinks: int = 4
    window: int = 0
    outlier_frac: float = 0.0

    def __post_init__(self) -> None:
        check_int(self.name, "group_size", self.group_size, 2)
        check_int(self.name, "sinks", self.sinks, 0)
        check_int(self.name, "window", self.window, 0)
        check_frac(self.name, self.outlier_frac)
        check_scale_bits(self.name, self.scale_bits)
        if self.key_axis not in KEY_AXES:
            raise ConfigError(f"int4: key_axis must be one of {KEY_AXES}, got {self.key_axis!r}")

    def codecs(self, spec: KVCacheSpec) -> tuple[Codec, Codec | None]:
        k = UniformCodec(4, self.key_axis, self.group_size, self.outlier_frac, self.scale_bits)
        v = UniformCodec(4, "token", self.group_size, self.outlier_frac, self.scale_bits) if spec.has_values else None
        return k, v

    def validate(self, spec: KVCacheSpec, block_size: int) -> None:
        super().validate(spec, block_size)
        dims = [spec.v_head_dim] if self.key_axis == "channel" else [spec.head_dim, spec.v_head_dim]
        check_group(self.name, self.group_size, [d for d in dims if d > 0])
        check_group(self.name, 2, [d for d in (spec.head_dim, spec.v_head_dim) if d > 0])
