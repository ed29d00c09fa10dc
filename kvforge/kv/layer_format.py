"""The two interfaces of a KV storage format: KVFormat (sizes, allocation) and LayerKV (one layer's blocks).

A format is a codec. Attention only sees fp32 rows coming out of `LayerKV.gather`.
Concrete formats live in kvforge.kv.formats (plain dtypes) and kvforge.kv.quant (quantized ones).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from kvforge.kv.spec import KVCacheSpec


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

    def forget_rows(self, block: int, offset: int) -> None:
        """Rows from `offset` on in `block` are void (rolled back); they will be written again before use."""

    @abstractmethod
    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this layer allocated, for exact byte accounting."""


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
