"""ModelDrafter: drafts with a (smaller) causal model, greedily, one token per step, over the lookahead rows.

The scheduler has already reserved each sequence's 1 + k rows (its last token and k drafts); drafting step j
feeds row j of every sequence still drafting and writes that row's K/V at the slot verification will use, so
the drafter's attention sees its own earlier drafts and the verification forward simply overwrites them
(rows it rejects are rolled back with the target's). Argmax drafts are point masses, so rejection sampling
stays exact (see verify.py).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from kvforge.attention import AttentionMetadata

PENDING = -1  # a reserved draft position whose token the drafter has not chosen yet


class ModelDrafter:
    def __init__(self, forward: Callable[[torch.Tensor, AttentionMetadata], torch.Tensor],
                 compute_logits: Callable[[torch.Tensor], torch.Tensor], cost_fraction: float):
        """cost_fraction: a drafted token's work as a fraction of a target row's (the adaptive planner's input)."""
        self.forward, self.compute_logits, self.cost_fraction = forward, compute_logits, cost_fraction

    @torch.inference_mode()
    def draft(self, last_tokens: list[int], num_drafts: list[int], meta: AttentionMetadata,
              device: torch.device) -> list[list[int]]:
        """Each sequence's num_drafts tokens after its last token. meta: the rows (positions, slots, context) of each
        sequence's last token and drafts, as the target will run them."""
        last, drafted = list(last_tokens), [[] for _ in num_drafts]
        for j in range(max(num_drafts)):
            active = [i for i, k in enumerate(num_drafts) if k > j]
            step = _row_metadata(meta, active, j)
            hidden = self.forward(torch.tensor([last[i] for i in active], dtype=torch.long, device=device), step)
            tokens = self.compute_logits(hidden).argmax(-1).tolist()
            for i, token in zip(active, tokens):
                drafted[i].append(token)
                last[i] = token
        return drafted

    def observe(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> None:
        """The target ran a forward over these rows; a drafter with its own cache mirrors it."""

    def rollback(self, seq, cache_len: int, table: list[int], block_size: int) -> None:
        """seq's cache was cut back to cache_len rows; a drafter with its own cache voids the same rows."""

    def stats(self) -> dict:
        return {}


def _row_metadata(meta: AttentionMetadata, seqs: list[int], j: int) -> AttentionMetadata:
    """One query row (the j-th new row) of each listed sequence, in every KV group's view of the step."""
    if meta.layer_views is None:
        return _row_view(meta, seqs, j)
    made: dict[int, AttentionMetadata] = {}
    views = [made.setdefault(id(v), _row_view(v, seqs, j)) for v in meta.layer_views]
    out = made.get(id(meta)) or _row_view(meta, seqs, j)
    out.layer_views = views
    return out


def _row_view(meta: AttentionMetadata, seqs: list[int], j: int) -> AttentionMetadata:
    """One view: row j of each listed sequence, attending to its cache up to that row."""
    rows = [meta.query_start_loc[i] + j for i in seqs]
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping[rows],
        positions=meta.positions[rows],
        query_lens=[1] * len(seqs),
        context_lens=[meta.context_lens[i] - meta.query_lens[i] + 1 + j for i in seqs],
        block_tables=[meta.block_tables[i] for i in seqs],
        block_size=meta.block_size,
        sliding_window=meta.sliding_window,
    )
