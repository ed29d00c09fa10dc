"""Exact fp16 rows (staging entries, sinks) laid over a block's decoded rows."""
from __future__ import annotations

import torch


def overlay_exact(decoded: list[torch.Tensor], entries: torch.Tensor, exact: list[torch.Tensor]) -> None:
    """Blocks with an entry (entries[i] >= 0) take that entry's exact rows over their first rows."""
    hit = entries >= 0
    if bool(hit.any()):
        for x, s in zip(decoded, exact):
            x[hit, : s.shape[1]] = s[entries[hit]].float()
