"""KIVI-2: 2-bit asymmetric KV cache (Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization").

Keys are quantized per channel over the tokens of one block, values per token in groups of
`group_size` along head_dim. The block being filled and the blocks holding the most recent
`window` tokens of each sequence stay fp16 in staging entries (the residual); they are quantized
once newer blocks need the entries (the oldest full block goes first).
Small models need more than plain KIVI:
  sinks         first positions of each sequence kept fp16 (StreamingLLM's attention sinks); needs
                `positions` passed to LayerKV.write; they are also excluded from the block's ranges.
  outlier_frac  per block, that fraction of values farthest from their group's mean kept fp16
                with a flat index (KVQuant's dense-and-sparse split, Hooper et al. 2024).
  scale_bits    8 (default): group scales as uint8 log2 codes, per-channel key zeros as uint8 codes
                (see uniform.py); 16: scale and zero in fp16.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvforge.kv.quant.base import QuantFormat, check_frac, check_group, check_int, check_scale_bits
from kvforge.kv.quant.codec import Codec
from kvforge.kv.quant.uniform import UniformCodec
from kvforge.kv.spec import KVCacheSpec


@dataclass
class KIVI2(QuantFormat):
    name = "kivi2"
    group_size: int = 32
    window: int = 128
    sinks: int = 4
    outlier_frac: float = 0.01
    scale_bits: int = 8

    def __post_init__(self) -> None:
        check_int(self.name, "group_size", self.group_size, 2)
        check_int(self.name, "window", self.window, 0)
        check_int(self.name, "sinks", self.sinks, 0)
        check_frac(self.name, self.outlier_frac)
        check_scale_bits(self.name, self.scale_bits)

    def codecs(self, spec: KVCacheSpec) -> tuple[Codec, Codec | None]:
        k = UniformCodec(2, "channel", self.group_size, self.outlier_frac, self.scale_bits)
        v = UniformCodec(2, "token", self.group_size, self.outlier_frac, self.scale_bits) if spec.has_values else None
        return k, v

    def validate(self, spec: KVCacheSpec, block_size: int) -> None:
        super().validate(spec, block_size)
        check_group(self.name, 4, [d for d in (spec.head_dim, spec.v_head_dim) if d > 0])
        if spec.has_values:
            check_group(self.name, self.group_size, [spec.v_head_dim])
