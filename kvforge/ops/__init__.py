"""Operators over the paged KV cache (registered with torch.library as `kvforge::*`).

`paged_decode`: one query token per sequence attends over its blocks as stored, each format decoded
inside the kernel (no gather of the history into fp32 temporaries). The torch reference (reference.py)
implements the op for every device; a compiled CPU kernel (csrc/, built by build.py) overrides it on CPU.
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
    if q.device.type != "cpu" or disabled() or not load_compiled():
        return None
    raw = raw_view(cache)
    if raw is None:
        return None
    lens = torch.as_tensor(context_lens, dtype=torch.long)
    return torch.ops.kvforge.paged_decode(q, block_table, lens, scale, window or 0, *op_args(raw))
