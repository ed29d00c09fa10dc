"""Model weights moved onto 2 MB pages (Linux transparent huge pages, asked for with madvise).

A decode step of one sequence streams every weight from memory once; on 4 KB pages a single thread reads them
at ~60-70% of the bandwidth it reaches on 2 MB pages (`python -m kvforge.bench.matmul --rows 1`).
PyTorch's allocator asks for huge pages only when THP_MEM_ALLOC_ENABLE is set before its first allocation,
so `move_to_huge_pages` copies a module's large fp32 CPU tensors into one anonymous mapping advised
MADV_HUGEPAGE and points them there (same tensor objects, same values; views and tied weights stay shared,
and tensors that had storages of their own still do, e.g. for `models/int8_weights.py`). When a storage dies
(int8 weights release their fp32 originals) its pages go back to the system, while the others stay mapped.
KVFORGE_HUGE_PAGES=0 opts out; where the platform has no MADV_HUGEPAGE it does nothing.
"""
from __future__ import annotations

import mmap
import os
import weakref
from collections.abc import Sequence

import torch
from torch import nn

PAGE = 2 << 20
MIN_BYTES = 1 << 20  # smaller storages (norms, biases) stay where they are
ALIGN = 64


def available() -> bool:
    return os.environ.get("KVFORGE_HUGE_PAGES", "1") != "0" and hasattr(mmap, "MADV_HUGEPAGE")


def huge_page_mapping(nbytes: int) -> tuple[mmap.mmap, int]:
    """An anonymous mapping advised MADV_HUGEPAGE with room for nbytes from a 2 MB-aligned offset (returned)."""
    mapping = mmap.mmap(-1, nbytes + PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    start = torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()
    return mapping, -start % PAGE


def move_to_huge_pages(module: nn.Module, extra: Sequence[torch.Tensor] = ()) -> int:
    """Move the module's fp32 CPU parameters and buffers whose storage holds at least MIN_BYTES, and the CPU tensors
    `extra` of any size and dtype (GGUF block weights, models/quant_weights.py), onto huge pages; returns the bytes
    moved (0 when unavailable). Each storage gets a storage of its own in the one mapping (each holds the mapping
    alive), so tensors share a storage afterwards exactly when they did before."""
    if not available():
        return 0
    tensors = [t for t in (*module.parameters(), *module.buffers()) if _movable(t)]
    tensors += [t for t in extra if t.device.type == "cpu"]
    storages: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        storages.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage())
    offsets, total = {}, 0
    for ptr, storage in storages.items():
        offsets[ptr] = total
        total += -(-storage.nbytes() // ALIGN) * ALIGN
    if total == 0:
        return 0
    targets = {id(t): (t, t.untyped_storage().data_ptr()) for t in tensors}
    mapping, base = huge_page_mapping(total)
    regions = {}
    with torch.no_grad():
        for ptr, storage in storages.items():
            regions[ptr] = _region(mapping, base + offsets[ptr], storage.nbytes()).copy_(_bytes_of(storage))
        for t, ptr in targets.values():
            t.data = regions[ptr].view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())
    return total


def _region(mapping: mmap.mmap, offset: int, nbytes: int) -> torch.Tensor:
    """Bytes [offset, offset + nbytes) of the mapping as a tensor whose storage, when it dies, returns the whole
    pages it covered (MADV_DONTNEED)."""
    view = memoryview(mapping)[offset: offset + nbytes]
    weakref.finalize(view, _discard, mapping, offset, nbytes)
    return torch.frombuffer(view, dtype=torch.uint8)


def _discard(mapping: mmap.mmap, offset: int, nbytes: int) -> None:
    start, end = -(-offset // mmap.PAGESIZE) * mmap.PAGESIZE, (offset + nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if end > start and not mapping.closed:
        mapping.madvise(mmap.MADV_DONTNEED, start, end - start)


def _movable(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype == torch.float32 and t.untyped_storage().nbytes() >= MIN_BYTES


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(storage)
