"""Sliding window: keep only the most recent tokens."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvforge.kv.policies.base import KVPolicy, PolicyState, recent


@dataclass
class WindowPolicy(KVPolicy):
    """Sliding-window attention as in Mistral 7B (Jiang et al., 2023, arXiv:2310.06825) and Longformer
    (Beltagy et al., 2020, arXiv:2004.05150): keep the `budget` most recent tokens, drop the rest.

    Keys stay rotated by their logical position, so the window is exact (no re-rotation), but a
    sequence cannot run past the model's context. Models whose config has `sliding_window` do not need
    it: their windowed layers form sliding KV groups (kvforge.kv.groups) that free blocks behind the window.
    """

    name = "window"
    default_budget = 1024  # when no budget is given

    def select(self, length: int, budget: int, state: PolicyState) -> torch.Tensor:
        return recent(length, budget)
