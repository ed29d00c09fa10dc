"""The operator's schema (torch.library), with the torch reference as its implementation for every device;
the compiled CPU kernel (csrc/paged_decode.cpp) registers for the CPU key and takes over there."""
from __future__ import annotations

import torch

from kvforge.ops import reference

LIB = torch.library.Library("kvforge", "FRAGMENT")
LIB.define("paged_decode(Tensor q, Tensor block_table, Tensor context_lens, float scale, int window, "
           "int[] k_meta, Tensor[] k_parts, int[] v_meta, Tensor[] v_parts, Tensor[] stage, Tensor[] sink) -> Tensor")
LIB.impl("paged_decode", reference.paged_decode, "CompositeExplicitAutograd")
