"""Tensors <-> raw bytes, for exporting KV blocks (any dtype, fp8 and bf16 included, bit for bit)."""
from __future__ import annotations

import math

import numpy as np
import torch


def rows_as_bytes(t: torch.Tensor) -> np.ndarray:
    """[n, ...] tensor -> [n, bytes per row] uint8 array holding each row's exact bits."""
    n = t.shape[0]
    flat = t.detach().contiguous().reshape(n, -1).cpu()
    return flat.view(torch.uint8).numpy() if flat.numel() else np.zeros((n, 0), np.uint8)


def tensor_from_bytes(buf: bytes | memoryview, shape: tuple[int, ...], dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor:
    """Inverse of rows_as_bytes for one row (or several, with shape's leading axis)."""
    raw = torch.frombuffer(bytearray(buf), dtype=torch.uint8) if len(buf) else torch.zeros(0, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape).to(device)


def nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize
