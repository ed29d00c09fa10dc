"""Tensors <-> raw bytes, for exporting KV blocks (any dtype, fp8 and bf16 included, bit for bit).

A layer exports a batch of blocks as `LayerRows`: byte columns holding every block in its plain form
(flag byte 0, then its codes), one row per block, plus whole payloads for the few blocks whose form differs
(staged or sink rows). The pool puts the columns of all its layers side by side, so a payload is one row of
one array: one copy per layer for all blocks, no per-block work per layer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class LayerRows:
    columns: list[np.ndarray]  # [n, bytes] uint8 each; together one plain payload per block
    special: dict[int, bytes] = field(default_factory=dict)  # block index -> its whole payload, when not plain


def rows_as_bytes(t: torch.Tensor) -> np.ndarray:
    """[n, ...] tensor -> [n, bytes per row] uint8 array holding each row's exact bits."""
    n = t.shape[0]
    flat = t.detach().contiguous().reshape(n, -1).cpu()
    return flat.view(torch.uint8).numpy() if flat.numel() else np.zeros((n, 0), np.uint8)


def flag_column(n: int, flag: int = 0) -> np.ndarray:
    return np.full((n, 1), flag, dtype=np.uint8)


def stack_payloads(payloads, start: int = 0, width: int | None = None) -> np.ndarray:
    """Bytes [start, start + width) of each payload as the rows of one [n, width] uint8 array."""
    if width is None:
        width = len(payloads[0]) - start if payloads else 0
    parts = [bytes(p[start:start + width]) if start or len(p) != width else p for p in payloads]
    return np.frombuffer(b"".join(parts), dtype=np.uint8).reshape(len(payloads), width)


def tensor_from_columns(table: np.ndarray, start: int, shape: tuple[int, ...], dtype: torch.dtype,
                        device: torch.device) -> torch.Tensor:
    """Columns [start, start + nbytes(shape, dtype)) of a [n, W] uint8 table as an [n, *shape] tensor."""
    cols = np.require(table[:, start:start + nbytes(shape, dtype)], requirements=["C", "W"])
    return torch.from_numpy(cols).view(dtype).reshape(len(table), *shape).to(device)


def put_rows(dst: torch.Tensor, ids: torch.Tensor, src: torch.Tensor) -> None:
    """dst[ids] = src, bit for bit, copied as the widest integers that tile a row (index_copy_ moves a 1-byte
    element at a time, ~20x slower than 8-byte words)."""
    row = dst[0].numel() * dst.element_size() if len(dst) else 0
    wide = next((d for d in (torch.int64, torch.int32, torch.int16) if row % d.itemsize == 0), torch.uint8)
    words = dst.view(len(dst), -1).view(torch.uint8).view(wide)  # a view: the copy lands in dst
    src = src.to(dst.device).contiguous()
    words.index_copy_(0, ids, src.view(len(src), -1).view(torch.uint8).view(wide))


def nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize
