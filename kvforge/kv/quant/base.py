"""QuantFormat: a KVFormat made of a key codec, a value codec, an optional fp16 residual window and sinks."""
from __future__ import annotations

import math
from abc import abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvforge.errors import ConfigError
from kvforge.kv.layer_format import KVFormat
from kvforge.kv.quant.codec import Codec
from kvforge.kv.quant.layer import EXACT_DTYPE, QuantLayerKV
from kvforge.kv.quant.scaled import ScaledCodec
from kvforge.kv.quant.sidetable import BYTES_PER_BLOCK, BYTES_PER_ENTRY
from kvforge.kv.quant.uniform import UniformCodec
from kvforge.kv.spec import KVCacheSpec

SINK_ENTRIES_PER_SEQ = 2
SCALE_BITS = (8, 16)


class QuantFormat(KVFormat):
    """Subclasses are dataclasses with their options and build codecs per spec.

    `window` (tokens kept fp16 per sequence, rounded up to blocks) and `sinks` (first positions of
    a sequence kept fp16) need per-sequence side storage, sized by `max_num_seqs` at allocation.
    """

    window: int = 0
    sinks: int = 0

    @abstractmethod
    def codecs(self, spec: KVCacheSpec) -> tuple[Codec, Codec | None]:
        """Key codec and value codec (None when the spec has no values, e.g. MLA)."""

    def staged(self, spec: KVCacheSpec) -> bool:
        return self.window > 0 or not all(c.per_token for c in self.codecs(spec) if c is not None)

    def stage_blocks(self, spec: KVCacheSpec, block_size: int) -> int:
        return math.ceil(self.window / block_size) + 1 if self.staged(spec) else 0

    def stage_entries(self, spec: KVCacheSpec, block_size: int, max_num_seqs: int) -> int:
        return max_num_seqs * self.stage_blocks(spec, block_size)

    def drop_unit(self, spec: KVCacheSpec, block_size: int) -> int:
        return 1 if all(c.per_token for c in self.codecs(spec) if c is not None) else block_size

    def sink_entries(self, max_num_seqs: int) -> int:
        return SINK_ENTRIES_PER_SEQ * max_num_seqs if self.sinks else 0

    def layer_block_bytes(self, spec: KVCacheSpec, block_size: int) -> int:
        dims = [d for d in (spec.head_dim, spec.v_head_dim) if d > 0]
        codes = sum(c.block_bytes(block_size, spec.num_kv_heads, d) for c, d in zip(self.codecs(spec), dims))
        tables = int(self.staged(spec)) + int(self.sinks > 0)
        return codes + tables * BYTES_PER_BLOCK

    def side_bytes(self, spec: KVCacheSpec, block_size: int, max_num_seqs: int = 1) -> int:
        """Bytes per layer that do not scale with blocks: fp16 staging/residual entries and sink entries."""
        row = spec.elements_per_token_per_layer * EXACT_DTYPE.itemsize
        stage = self.stage_entries(spec, block_size, max_num_seqs)
        sink = self.sink_entries(max_num_seqs)
        stage_bytes = stage * (block_size * row + BYTES_PER_ENTRY + 1)
        return stage_bytes + sink * (self.sinks * row + BYTES_PER_ENTRY)

    def allocate(self, spec: KVCacheSpec, num_blocks: int, block_size: int, device: torch.device,
                 max_num_seqs: int = 1) -> QuantLayerKV:
        self.validate(spec, block_size)
        return QuantLayerKV(spec, num_blocks, block_size, self.codecs(spec),
                            self.stage_entries(spec, block_size, max_num_seqs),
                            self.sinks, self.sink_entries(max_num_seqs), device)

    def validate(self, spec: KVCacheSpec, block_size: int) -> None:
        if block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {block_size}")
        if self.sinks and self.sinks >= block_size:
            raise ConfigError(f"{self.name}: sinks={self.sinks} must be smaller than block_size={block_size}")


@dataclass
class ScaledFormat(QuantFormat):
    """Keys and values as `code_dtype` codes with one scale per token and head (int8, fp8).

    sinks: first positions of each sequence kept fp16 as well (default 0); window: most recent tokens
    per sequence kept fp16 (default 0, rounded up to whole blocks).
    """

    code_dtype: ClassVar[torch.dtype]
    sinks: int = 0
    window: int = 0

    def __post_init__(self) -> None:
        check_int(self.name, "sinks", self.sinks, 0)
        check_int(self.name, "window", self.window, 0)

    def codecs(self, spec: KVCacheSpec) -> tuple[Codec, Codec | None]:
        return ScaledCodec(self.code_dtype), ScaledCodec(self.code_dtype) if spec.has_values else None


@dataclass
class UniformFormat(QuantFormat):
    """`bits`-bit asymmetric groups: keys along `key_axis`, values per token in groups along head_dim."""

    bits: ClassVar[int]
    key_axis: ClassVar[str] = "channel"
    group_size: int = 32
    sinks: int = 4
    window: int = 0
    outlier_frac: float = 0.0
    scale_bits: int = 8

    def __post_init__(self) -> None:
        check_int(self.name, "group_size", self.group_size, 2)
        check_int(self.name, "sinks", self.sinks, 0)
        check_int(self.name, "window", self.window, 0)
        check_frac(self.name, self.outlier_frac)
        check_scale_bits(self.name, self.scale_bits)

    def codecs(self, spec: KVCacheSpec) -> tuple[Codec, Codec | None]:
        options = (self.group_size, self.outlier_frac, self.scale_bits)
        k = UniformCodec(self.bits, self.key_axis, *options)
        v = UniformCodec(self.bits, "token", *options) if spec.has_values else None
        return k, v

    def validate(self, spec: KVCacheSpec, block_size: int) -> None:
        super().validate(spec, block_size)
        grouped = [spec.v_head_dim] if self.key_axis == "channel" else [spec.head_dim, spec.v_head_dim]
        check_group(self.name, self.group_size, [d for d in grouped if d > 0])
        check_group(self.name, 8 // self.bits, [d for d in (spec.head_dim, spec.v_head_dim) if d > 0])  # whole bytes


def check_int(fmt: str, option: str, value: object, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"{fmt}: option {option} must be an integer >= {low}, got {value!r}")


def check_scale_bits(fmt: str, value: object) -> None:
    if value not in SCALE_BITS:
        raise ConfigError(f"{fmt}: scale_bits must be one of {SCALE_BITS}, got {value!r}")


def check_group(fmt: str, group_size: int, dims: list[int]) -> None:
    for d in dims:
        if d % group_size:
            raise ConfigError(f"{fmt}: group_size={group_size} must divide head_dim {d}; "
                              f"allowed: a divisor of {d}")


def check_frac(fmt: str, value: object) -> None:
    if not isinstance(value, (int, float)) or not 0.0 <= value < 0.5:
        raise ConfigError(f"{fmt}: outlier_frac must be a number in [0, 0.5), got {value!r}")
