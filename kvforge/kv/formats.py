"""KV storage formats: how a block of K/V rows is stored (encode on write, decode on read).

A format is a codec. Attention only sees fp32 rows coming out of `LayerKV.gather`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvforge.errors import ConfigError
from kvforge.kv.spec import KVCacheSpec
from kvforge.options import json_object


@dataclass(frozen=True)
class RawSide:
    """K or V as stored, for operators that decode blocks in place (kvforge.ops).

    kind: "plain" (rows in fp32/fp16/bf16), "scaled" (codes, one fp16 scale per row and head) or
    "uniform_token" / "uniform_channel" (packed `bits`-bit codes, parameters per `group` along head_dim
    or per channel over a block); `parts` is the codec's layout in the order kvforge/ops/csrc/tiles.h lists.
    """

    kind: str
    parts: list[torch.Tensor]
    bits: int = 0
    group: int = 0


@dataclass(frozen=True)
class RawKV:
    """A layer's storage as tensors: K and V sides, plus exact fp16 rows laid over decoded blocks:
    `stage` and `sink` are [] or [entry_of (block -> entry, -1 none), K rows, V rows]."""

    k: RawSide
    v: RawSide
    stage: list[torch.Tensor] = field(default_factory=list)
    sink: list[torch.Tensor] = field(default_factory=list)


class LayerKV(ABC):
    """One layer's physical block storage in some format."""

    @abstractmethod
    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
              positions: torch.Tensor | None = None) -> None:
        """Store rows k[i] (and v[i]) of shape [T, heads, dim] at flat slot ids slots[i].

        positions[i] is row i's token position in its sequence (formats with exact sinks need it).
        Each slot appears at most once per call; a block written at offset 0 is treated as new.
        """

    @abstractmethod
    def gather(self, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """fp32 K and V of the given blocks, concatenated: [len(block_ids) * block_size, heads, dim]."""

    @abstractmethod
    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy whole blocks (for copy-on-write)."""

    @abstractmethod
    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this layer allocated, for exact byte accounting."""

    def raw(self) -> RawKV | None:
        """The storage as tensors for in-place decoding operators; None when this layer has no such view."""
        return None


class KVFormat(ABC):
    """A storage codec. Subclasses register themselves by `name`."""

    name: ClassVar[str]
    registry: ClassVar[dict[str, type[KVFormat]]] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if getattr(cls, "name", None):
            KVFormat.registry[cls.name] = cls

    @abstractmethod
    def layer_block_bytes(self, spec: KVCacheSpec, block_size: int) -> int:
        """Bytes one block of one layer occupies (codes, scales and any side buffers)."""

    def side_bytes(self, spec: KVCacheSpec, block_size: int, max_num_seqs: int = 1) -> int:
        """Bytes one layer holds beyond its blocks (per-sequence staging/residual and sink buffers)."""
        return 0

    @abstractmethod
    def allocate(self, spec: KVCacheSpec, num_blocks: int, block_size: int, device: torch.device,
                 max_num_seqs: int = 1) -> LayerKV:
        """Allocate one layer's storage for num_blocks blocks (side buffers sized for max_num_seqs).

        Exactly num_blocks * layer_block_bytes + side_bytes(max_num_seqs) bytes in tensors().
        """

    def validate(self, spec: KVCacheSpec, block_size: int) -> None:
        """Raise ConfigError when this format cannot store `spec` with `block_size`."""


class PlainLayerKV(LayerKV):
    def __init__(self, spec: KVCacheSpec, num_blocks: int, block_size: int, dtype: torch.dtype, device):
        shape = (num_blocks, block_size, spec.num_kv_heads)
        self.k = torch.zeros(*shape, spec.head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(*shape, spec.v_head_dim, dtype=dtype, device=device) if spec.has_values else None

    def write(self, slots, k, v, positions=None):
        self.k.view(-1, *self.k.shape[2:])[slots] = k.to(self.k.dtype)
        if self.v is not None:
            self.v.view(-1, *self.v.shape[2:])[slots] = v.to(self.v.dtype)

    def gather(self, block_ids):
        k = self.k.index_select(0, block_ids).flatten(0, 1).float()
        v = self.v.index_select(0, block_ids).flatten(0, 1).float() if self.v is not None else None
        return k, v

    def copy_blocks(self, src, dst):
        for t in self.tensors():
            t[dst] = t[src]

    def tensors(self):
        return [t for t in (self.k, self.v) if t is not None]

    def raw(self):
        return RawKV(RawSide("plain", [self.k]), RawSide("plain", [self.v])) if self.v is not None else None


class PlainFormat(KVFormat):
    dtype: ClassVar[torch.dtype]

    def layer_block_bytes(self, spec, block_size):
        return block_size * spec.elements_per_token_per_layer * self.dtype.itemsize

    def allocate(self, spec, num_blocks, block_size, device, max_num_seqs=1):
        return PlainLayerKV(spec, num_blocks, block_size, self.dtype, device)


class FP32(PlainFormat):
    """Full precision; the default on CPU."""

    name = "fp32"
    dtype = torch.float32


class FP16(PlainFormat):
    """IEEE half storage, compute in fp32."""

    name = "fp16"
    dtype = torch.float16


class BF16(PlainFormat):
    """bfloat16 storage, compute in fp32."""

    name = "bf16"
    dtype = torch.bfloat16


def get_format(name: str, **options) -> KVFormat:
    """The format called `name`, built with its options (e.g. group_size)."""
    cls = KVFormat.registry.get(name)
    if cls is None:
        allowed = ", ".join(sorted(KVFormat.registry))
        raise ConfigError(f"unknown kv_cache_dtype {name!r}; allowed: {allowed}")
    try:
        return cls(**options)
    except TypeError as e:
        raise ConfigError(f"kv_cache_dtype {name!r} does not take options {sorted(options)}: {e}") from None


def parse_format_spec(text: str) -> tuple[str, dict]:
    """'int4' or 'int4:{"group_size": 32}' -> (name, options)."""
    name, _, raw = text.partition(":")
    return name, json_object(f"format {text!r}: the options after ':'", raw, 'int4:{"group_size": 32}')


# Quantized formats register themselves on import (they subclass KVFormat, so this comes last).
from kvforge.kv.quant import fp8, int4, int8, kivi2  # noqa: F401
