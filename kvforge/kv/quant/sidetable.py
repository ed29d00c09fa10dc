"""SideTable: a small pool of entries lent to blocks (block -> entry map), reclaimed oldest first."""
from __future__ import annotations

from dataclasses import dataclass

import torch

BYTES_PER_BLOCK = 4
BYTES_PER_ENTRY = 12


@dataclass
class Claim:
    entries: torch.Tensor  # entries given to blocks[taken]
    taken: torch.Tensor  # bool per requested block: got an entry (the last ones win when short)
    victim_blocks: torch.Tensor  # blocks that lost their entry to this claim
    victim_entries: torch.Tensor  # the entries they held (content still there until overwritten)


class SideTable:
    """Maps blocks to at most `num_entries` entries; all bookkeeping is vectorised torch."""

    def __init__(self, num_blocks: int, num_entries: int, device: torch.device):
        self.entry_of = torch.full((num_blocks,), -1, dtype=torch.int32, device=device)
        self.block_of = torch.full((num_entries,), -1, dtype=torch.int32, device=device)
        self.age = torch.zeros(num_entries, dtype=torch.int64, device=device)
        self.clock = 0

    def tensors(self) -> list[torch.Tensor]:
        return [self.entry_of, self.block_of, self.age]

    def lookup(self, blocks: torch.Tensor) -> torch.Tensor:
        return self.entry_of[blocks].long()

    def release(self, blocks: torch.Tensor) -> None:
        e = self.lookup(blocks)
        self.block_of[e[e >= 0]] = -1
        self.entry_of[blocks] = -1

    def claim(self, blocks: torch.Tensor, keep_bias: torch.Tensor | None = None) -> Claim:
        """Give entries to `blocks` (none of which holds one): free entries first, then the lowest
        age + keep_bias. Callers must save the victims' content before overwriting their entries."""
        m, n = len(blocks), len(self.block_of)
        k = min(m, n)
        used = self.block_of >= 0
        key = torch.where(used, self.age + (keep_bias if keep_bias is not None else 0), -1)
        entries = key.topk(k, largest=False).indices if k else key[:0].long()
        prev = self.block_of[entries].long()
        victims = prev >= 0
        self.entry_of[prev[victims]] = -1
        chosen = blocks[m - k:]
        self.block_of[entries] = chosen.to(torch.int32)
        self.entry_of[chosen] = entries.to(torch.int32)
        self.age[entries] = self.clock + torch.arange(k, device=entries.device)
        self.clock += k
        taken = torch.zeros(m, dtype=torch.bool, device=blocks.device)
        taken[m - k:] = True
        return Claim(entries, taken, prev[victims], entries[victims])
