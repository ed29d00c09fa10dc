"""The two interfaces of a KV storage format: KVFormat (sizes, allocation) and LayerKV (one layer's blocks).

A format is a codec. Attention only sees fp32 rows coming out of `LayerKV.gather`.
Concrete formats live in kvforge.kv.formats (plain dtypes) and kvforge.kv.quant (quantized ones).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

from kvforge.kv.block_bytes import LayerRows
from kvforge.kv.spec import KVCacheSpec


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

    may_stage: torch.Tensor | None = None  # bool per block: lies in some request's fp16 window (formats that stage)
    sink_pins: torch.Tensor | None = None  # int per block: running requests whose first block it is (exact sinks)

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

    def read_rows(self, slots: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """fp32 K and V rows at flat slots, [len(slots), heads, dim]."""
        blocks, where = torch.unique(slots.long() // block_size, return_inverse=True)
        rows = where * block_size + slots.long() % block_size
        k, v = self.gather(blocks)
        return k[rows], (v[rows] if v is not None else None)

    def move(self, src: torch.Tensor, dst: torch.Tensor, block_size: int) -> None:
        """Rows at flat slots src go to slots dst (compaction: dst[i] <= src[i], both increasing) with the
        values they decode to unchanged. This default re-writes them, exact for the plain dtypes."""
        k, v = self.read_rows(src, block_size)
        self.write(dst, k, v)

    def read_head_rows(self, src: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """fp32 K and V where head h of row i is head h of the row at flat slot src[i, h]: [n, heads, dim]."""
        n, heads = src.shape
        k, v = self.read_rows(src.flatten(), block_size)
        h = torch.arange(heads, device=k.device)
        pick = (lambda x: x.view(n, heads, heads, -1)[:, h, h]) if heads > 1 else (lambda x: x.view(n, 1, -1))
        return pick(k), (pick(v) if v is not None else None)

    def move_heads(self, src: torch.Tensor, dst: torch.Tensor, block_size: int) -> None:
        """Like `move`, head by head: head h of the row at slot dst[i] takes head h of the row at src[i, h]
        (a KV policy that keeps its own rows per head). This default re-writes them, exact for the plain dtypes."""
        k, v = self.read_head_rows(src.long(), block_size)
        self.write(dst, k, v)

    def rewrite(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> None:
        """New values for rows already stored at slots (their blocks are not new, whatever the offset)."""
        self.write(slots, k, v)

    def forget_rows(self, block: int, offset: int) -> None:
        """Rows from `offset` on in `block` are void (rolled back); they will be written again before use."""

    def unstage(self, blocks: torch.Tensor) -> None:
        """`blocks` left their request's fp16 window (see KVFormat.stage_blocks): store them as they will be read."""

    def forget_blocks(self, blocks: torch.Tensor) -> None:
        """`blocks` are free: drop whatever side entries they hold."""

    @abstractmethod
    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this layer allocated, for exact byte accounting."""

    def plain_rows(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(K, V) storage, [blocks, block_size, heads, dim] each, when a caller may store new rows in them directly
        (scattered at flat slots, cast to their dtype) instead of calling `write`; None when rows must be encoded."""
        return None

    def raw(self) -> RawKV | None:
        """The storage as tensors for in-place decoding operators; None when this layer has no such view."""
        return None

    @abstractmethod
    def export_blocks(self, block_ids: torch.Tensor) -> LayerRows:
        """Each block's exact stored state as bytes (a flag byte, then the encoded rows): lossless, and the
        block itself is left as it was. Plain blocks (flag 0) as byte columns, the others as whole payloads."""

    @abstractmethod
    def import_blocks(self, block_ids: torch.Tensor, payloads: list[bytes | memoryview]) -> None:
        """Make each (freshly allocated) block hold exactly what `export_blocks` returned for it."""

    @abstractmethod
    def import_rows(self, block_ids: torch.Tensor, table: np.ndarray) -> None:
        """`import_blocks` for plain payloads (flag 0) given as the rows of one [n, payload_bytes(0)] uint8 array."""

    @abstractmethod
    def payload_bytes(self, flag: int) -> int:
        """Length of a payload of this layer that starts with the flag byte `flag`."""


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

    def stage_blocks(self, spec: KVCacheSpec, block_size: int) -> int:
        """Blocks of each sequence (per KV group) kept in fp16 staging: its window, the block being filled last;
        0 when the format stages nothing. The KV manager tells the layers which blocks these are (`may_stage`)."""
        return 0

    def drop_unit(self, spec: KVCacheSpec, block_size: int) -> int:
        """A KV policy's compaction drops rows in multiples of this where its budget allows: 1 when moved rows keep
        their codes anywhere; the block size where a block's rows share parameters (per-channel keys), so the rows
        behind the last dropped one shift by whole blocks and keep theirs (QuantLayerKV.move, move_heads)."""
        return 1

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
