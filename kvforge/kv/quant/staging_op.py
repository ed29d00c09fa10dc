"""kvforge::stage_append: a decode step's new rows into their blocks' fp16 staging entries (layer.py), one operator
call per layer. Defined here with its torch reference, for every device; ops/csrc/stage_append.cpp registers the
compiled CPU kernel when the project's kernels are built."""
from __future__ import annotations

import torch

from kvforge.kv.quant.library import define

SCHEMA = ("stage_append(Tensor slots, Tensor k, Tensor? v, Tensor entry_of, Tensor(a!) stage_k, Tensor(b!)? stage_v, "
          "Tensor(c!) stage_full, int block_size, int max_rows, Tensor? positions, int sinks) -> bool")


def stage_append_reference(slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, entry_of: torch.Tensor,
                           stage_k: torch.Tensor, stage_v: torch.Tensor | None, stage_full: torch.Tensor,
                           block_size: int, max_rows: int, positions: torch.Tensor | None, sinks: int) -> bool:
    """When 1..max_rows rows all land past the first row of a block that holds a staging entry (entry_of[block]
    >= 0) and at positions >= sinks, store them as fp16 rows of stage_k / stage_v [entries, block_size, ...], mark
    entries whose last row was written full, and return True; else change nothing and return False."""
    if not 0 < len(slots) <= max_rows:
        return False
    offs = [s % block_size for s in slots.tolist()]
    if 0 in offs or (positions is not None and sinks > 0 and min(positions.tolist()) < sinks):
        return False
    entries = entry_of[slots.long() // block_size].tolist()
    if min(entries) < 0:
        return False
    at = torch.tensor([e * block_size + o for e, o in zip(entries, offs)], device=slots.device)
    for stage, x in ((stage_k, k), (stage_v, v)):
        if stage is not None and x is not None:
            stage.view(-1, *stage.shape[2:]).index_copy_(0, at, x.float().to(stage.dtype))
    full = [e for e, o in zip(entries, offs) if o == block_size - 1]
    if full:
        stage_full[torch.tensor(full, device=slots.device)] = True
    return True


stage_append = define("stage_append", SCHEMA, stage_append_reference)
