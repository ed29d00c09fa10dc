"""Zeroed KV storage whose memory is committed as it is first written.

On CPU a large tensor lives in a fresh anonymous mapping (MAP_NORESERVE): its pages read as zeros and the
kernel commits one only when it is first written, so building a pool costs address space, not RAM or time, and
the process's RSS follows the blocks really used (the KV budget stays a ceiling). Other devices, and tensors
under a page or two, get torch.zeros. KVFORGE_LAZY_KV=0 zeroes everything up front (the old behaviour).
"""
from __future__ import annotations

import math
import mmap
import os
import sys

import torch

MIN_LAZY_BYTES = 64 << 10  # smaller tensors (side tables, flags) are zeroed at once
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)


def lazy_enabled() -> bool:
    return os.environ.get("KVFORGE_LAZY_KV", "1") != "0" and hasattr(mmap, "MAP_ANONYMOUS")


def lazy_zeros(*shape: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A tensor of zeros of `shape`; on CPU, above MIN_LAZY_BYTES, backed by untouched anonymous pages."""
    device = torch.device(device)
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes < MIN_LAZY_BYTES or not lazy_enabled():
        return torch.zeros(*shape, dtype=dtype, device=device)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
    return torch.frombuffer(mapping, dtype=dtype).view(*shape)  # the tensor's storage holds the mapping
