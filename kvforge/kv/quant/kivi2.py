"""KIVI-2: 2-bit asymmetric KV cache (Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization").

Keys are quantized per channel over the tokens of one block, values per token in groups of
`group_size` along head_dim. The block being filled and the blocks holding the most recent
`window` tokens of each sequence stay fp16 in staging entries (the residual); a block is quantized
once its own sequence moves past it (kv/staging.py), whatever other sequences do.
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

from kvforge.kv.quant.base import UniformFormat


@dataclass
class KIVI2(UniformFormat):
    name = "kivi2"
    bits = 2
    group_size: int = 32
    window: int = 128
    outlier_frac: float = 0.01
