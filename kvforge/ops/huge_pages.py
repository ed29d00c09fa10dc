"""Model weights moved onto 2 MB pages (Linux transparent huge pages, asked for with madvise).

A decode step of one sequence streams every weight from memory once; on 4 KB pages a single thread reads them
at ~60% of the bandwidth it reaches on 2 MB pages (`python -m kvforge.ops.bench_matmul --rows 1 --pages both`).
PyTorch's allocator asks for huge pages only when THP_MEM_ALLOC_ENABLE is set before its first allocation,
so `move_to_huge_pages` copies a module's large fp32 CPU tensors into one anonymous mapping advised
MADV_HUGEPAGE and points them there (same tensor objects, same values; views and tied weights stay shared).
KVFORGE_HUGE_PAGES=0 opts out; where the platform has no MADV_HUGEPAGE it does nothing.
"""
from __future__ import annotations

import mmap
import os

import torch
from torch import nn

PAGE = 2 << 20
MIN_BYTES = 1 << 20  # smaller storages (norms, biases) stay where they are
ALIGN = 64


def available() -> bool:
    return os.environ.get("KVFORGE_HUGE_PAGES", "1") != "0" and hasattr(mmap, "MADV_HUGEPAGE")


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """A zeroed uint8 tensor of nbytes on 2 MB-aligned memory advised MADV_HUGEPAGE (its mapping lives as long
    as the tensor's storage does)."""
    mapping = mmap.mmap(-1, nbytes + PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    skip = -whole.data_ptr() % PAGE
    return whole[skip: skip + nbytes]


def move_to_huge_pages(module: nn.Module) -> int:
    """Move the module's fp32 CPU parameters and buffers whose storage holds at least MIN_BYTES onto huge pages;
    returns the bytes moved (0 when unavailable)."""
    if not available():
        return 0
    tensors = [t for t in (*module.parameters(), *module.buffers()) if _movable(t)]
    storages: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        storages.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage())
    offsets, total = {}, 0
    for ptr, storage in storages.items():
        offsets[ptr] = total
        total += -(-storage.nbytes() // ALIGN) * ALIGN
    if total == 0:
        return 0
    targets = {id(t): (t, offsets[t.untyped_storage().data_ptr()] + t.storage_offset() * t.element_size())
               for t in tensors}
    arena = huge_page_buffer(total)
    with torch.no_grad():
        for ptr, storage in storages.items():
            arena[offsets[ptr]: offsets[ptr] + storage.nbytes()].copy_(_bytes_of(storage))
        for t, start in targets.values():
            t.data = arena[start:].view(t.dtype).as_strided(t.shape, t.stride())
    return total


def _movable(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype == torch.float32 and t.untyped_storage().nbytes() >= MIN_BYTES


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(storage)
