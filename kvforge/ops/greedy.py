"""Greedy choice over a step's logits: `argmax_rows(logits)` [N, V] fp32 -> int64 [N], each row's first index of
its largest value (csrc/greedy.cpp where built; torch.argmax otherwise, which is its reference). Rows holding a NaN
are the sampler's to fail: their index is unspecified."""
from __future__ import annotations

import torch

from kvforge.ops.build import disabled, has_cpu_kernel

LIB = torch.library.Library("kvforge", "FRAGMENT")
LIB.define("argmax_rows(Tensor logits) -> Tensor")


def argmax_rows_reference(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


LIB.impl("argmax_rows", argmax_rows_reference, "CompositeExplicitAutograd")


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    if (logits.is_cpu and logits.dtype == torch.float32 and logits.dim() == 2 and 0 < logits.shape[1] < 2**31
            and not disabled() and has_cpu_kernel("kvforge::argmax_rows")):
        return torch.ops.kvforge.argmax_rows(logits)
    return argmax_rows_reference(logits)
