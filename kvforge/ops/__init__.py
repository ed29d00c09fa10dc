"""Operators over the paged KV cache (registered with torch.library as `kvforge::*`).

`paged_decode`: one query token per sequence attends over its blocks as stored, each format decoded
inside the kernel (no gather of the history into fp32 temporaries). `paged_attend`: several query tokens per
sequence (speculative verification rows, prefill chunks over cached history), each up to its own position, every
block read once for all of a sequence's queries. The torch references (reference.py) implement the ops for every
device; compiled CPU kernels (csrc/, built by build.py) override them on CPU.
"""
from __future__ import annotations

import weakref

import torch

from kvforge.kv.layer_format import LayerKV, RawKV, RawSide
from kvforge.ops import schema  # noqa: F401  (defines torch.ops.kvforge.*)
from kvforge.ops.build import disabled, load_compiled
from kvforge.ops.reference import KINDS

_RAW: weakref.WeakKeyDictionary[LayerKV, RawKV | None] = weakref.WeakKeyDictionary()


def side_args(side: RawSide) -> tuple[list[int], list[torch.Tensor]]:
    return [KINDS[side.kind], side.bits, side.group], side.parts


def op_args(raw: RawKV) -> tuple:
    """The op's arguments after (q, block_table, context_lens, scale, window)."""
    return (*side_args(raw.k), *side_args(raw.v), raw.stage, raw.sink)


def raw_view(cache: LayerKV) -> RawKV | None:
    """cache.raw(), once per layer (storage tensors are updated in place, so the view stays valid)."""
    if cache not in _RAW:
        _RAW[cache] = cache.raw()
    return _RAW[cache]


def paged_decode(q: torch.Tensor, cache: LayerKV, block_table: torch.Tensor, context_lens: torch.Tensor | list[int],
                 scale: float, window: int | None) -> torch.Tensor | None:
    """Compiled decode attention for q [B, heads, dim] (row b: block_table[b], context_lens[b] keys, the
    last `window` of them when set) -> [B, heads, v_dim]; None when there is no compiled kernel for this
    device or layer format, and the caller runs its torch path."""
    args = _compiled_cache_args(q, cache)
    if args is None:
        return None
    lens = torch.as_tensor(context_lens, dtype=torch.long)
    return torch.ops.kvforge.paged_decode(q, block_table, lens, scale, window or 0, *args)


def _compiled_cache_args(q: torch.Tensor, cache: LayerKV) -> tuple | None:
    """The cache's operator arguments, or None when no compiled kernel serves this device or layer format."""
    if q.device.type != "cpu" or disabled() or not load_compiled():
        return None
    raw = raw_view(cache)
    return None if raw is None else op_args(raw)


def paged_attend(q: torch.Tensor, cache: LayerKV, query_start: torch.Tensor, block_table: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, window: int | None) -> torch.Tensor | None:
    """Compiled attention for q [T, heads, dim], sequence b owning rows query_start[b]:query_start[b + 1] (the last
    of its context_lens[b] keys, each seeing keys up to its own position) -> [T, heads, v_dim]; None as paged_decode."""
    args = _compiled_cache_args(q, cache)
    if args is None:
        return None
    return torch.ops.kvforge.paged_attend(q, query_start, block_table, context_lens, scale, window or 0, *args)
