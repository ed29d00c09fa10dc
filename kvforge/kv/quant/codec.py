"""Codec: turns fp32 blocks [n, block_size, heads, dim] into a fixed set of code tensors and back."""
from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch

from kvforge.kv.layer_format import RawSide

Layout = list[tuple[tuple[int, ...], torch.dtype]]


class Codec(ABC):
    """Encodes whole blocks. `per_token` codecs store each row independently (rows can be written alone)."""

    per_token: bool = True

    @abstractmethod
    def layout(self, block_size: int, heads: int, dim: int) -> Layout:
        """Shape (without the leading block axis) and dtype of every part one block stores.

        For per-token codecs every shape starts with block_size, so parts can be indexed by slot.
        """

    @abstractmethod
    def encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        """[n, rows, heads, dim] fp32 -> parts, each [n, *shape]."""

    @abstractmethod
    def decode(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """Parts of n blocks -> fp32 [n, rows, heads, dim]."""

    def head_axes(self) -> list[int] | None:
        """Each part's axis (in its per-block shape) that runs over KV heads, so one head of a block can be copied
        alone; None when some part mixes heads (e.g. a block's outlier list)."""
        return None

    def block_bytes(self, block_size: int, heads: int, dim: int) -> int:
        return sum(math.prod(shape) * dtype.itemsize for shape, dtype in self.layout(block_size, heads, dim))

    def raw_side(self, parts: list[torch.Tensor]) -> RawSide | None:
        """This codec's stored parts for in-place decoding operators (kvforge.ops); None if it has no such view."""
        return None
