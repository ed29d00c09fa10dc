"""One step's recurrent sequences as padded batches, so a recurrent layer runs one update per batch, not per sequence.

The step's sequences with one new token (decodes) form one batch, those with 2..SHORT_MAX new tokens (short
prefill chunks, speculative verify rows) another, padded at the end to the batch's longest; longer ones stay one by one
(their per-sequence cost is spread over many tokens). Padding sits after a sequence's last token, so with its
inputs masked out (dt = 0 in a scan) it leaves no trace in the state; the conv window kept is the one after the last
real token. The plan is built once per step (the same metadata serves every layer) and cached on the metadata.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# Longer sequences than this run one by one: at Granite-4.0-H widths a prefill's cost is its projections, and the padded
# scan was no faster than the per-sequence one from ~24 tokens on (16 x 40 tokens: 67 vs 57 ms per mixer layer).
SHORT_MAX = 16  # <= the Mamba-2 scan's segment (64): a padded batch is one segment long


@dataclass
class PaddedBatch:
    seqs: list[int]  # the step's sequence indices in this batch
    slots: torch.Tensor  # [B] their state slots
    lens: torch.Tensor  # [B] new tokens of each
    length: int  # L: the longest
    rows: torch.Tensor  # [B, L] row of the step's input for each place; padding -> the step's row count (a zero row)
    valid: torch.Tensor  # [B, L] True where a real token is
    flat_rows: torch.Tensor  # rows[valid]: where the batch's real places go back to
    cut_batch: torch.Tensor  # [C] batch index of each checkpoint cut
    cut_lens: torch.Tensor  # [C] tokens into its sequence
    cut_ids: list[tuple[int, int]]  # (step sequence index, cut) of each, for the state pool's captures
    cut_at: list[tuple[int, int]]  # (batch index, cut) of each
    lens_list: list[int]
    slot_run: slice | None  # the slots as one ascending run: the batch's states are a view of the pool's

    def gather(self, pool_tensor: torch.Tensor) -> torch.Tensor:
        """The batch's rows of a [num_slots, ...] state tensor (a view when the slots are one run)."""
        return pool_tensor[self.slot_run] if self.slot_run is not None else pool_tensor.index_select(0, self.slots)

    def scatter(self, pool_tensor: torch.Tensor, rows: torch.Tensor) -> None:
        """Put the batch's rows back (nothing to do for the view `gather` gave)."""
        if self.slot_run is None or rows.data_ptr() != pool_tensor[self.slot_run].data_ptr():
            pool_tensor.index_copy_(0, self.slots, rows)


@dataclass
class StepPlan:
    batches: list[PaddedBatch]
    singles: list[int]  # step sequence indices run one by one


def _batch(meta, seqs: list[int], device: torch.device) -> PaddedBatch:
    seqs = sorted(seqs, key=lambda i: meta.state_slots[i])  # ascending slots: maybe one run, a view of the pool
    slots = [meta.state_slots[i] for i in seqs]
    run = slots == list(range(slots[0], slots[0] + len(slots)))
    lens = [meta.query_lens[i] for i in seqs]
    length, total = max(lens), sum(meta.query_lens)
    rows = torch.full((len(seqs), length), total, dtype=torch.long)
    for b, i in enumerate(seqs):
        rows[b, :lens[b]] = torch.arange(meta.query_start_loc[i], meta.query_start_loc[i] + lens[b])
    valid = rows < total
    cut_ids = [(i, cut) for i in seqs for cut in (meta.state_cuts[i] if meta.state_cuts else [])]
    position = {i: b for b, i in enumerate(seqs)}
    return PaddedBatch(
        seqs=seqs, slots=torch.tensor(slots, dtype=torch.long, device=device),
        lens=torch.tensor(lens, dtype=torch.long, device=device), length=length, rows=rows.to(device),
        valid=valid.to(device), flat_rows=rows[valid].to(device),
        cut_batch=torch.tensor([position[i] for i, _ in cut_ids], dtype=torch.long, device=device),
        cut_lens=torch.tensor([cut for _, cut in cut_ids], dtype=torch.long, device=device), cut_ids=cut_ids,
        cut_at=[(position[i], cut) for i, cut in cut_ids], lens_list=lens,
        slot_run=slice(slots[0], slots[0] + len(slots)) if run else None)


def step_plan(meta, device: torch.device) -> StepPlan:
    """The step's recurrent batches (built on the first recurrent layer, reused by the others)."""
    plan = getattr(meta, "_state_plan", None)
    if plan is None:
        decodes = [i for i, n in enumerate(meta.query_lens) if n == 1]
        shorts = [i for i, n in enumerate(meta.query_lens) if 1 < n <= SHORT_MAX]
        plan = StepPlan(batches=[_batch(meta, part, device) for part in (decodes, shorts) if part],
                        singles=[i for i, n in enumerate(meta.query_lens) if n > SHORT_MAX])
        meta._state_plan = plan
    return plan


def padded(rows_of_step: torch.Tensor, batch: PaddedBatch) -> torch.Tensor:
    """[T, ...] step rows -> [B, L, ...] (padding places read a zero row)."""
    zero = rows_of_step.new_zeros((1, *rows_of_step.shape[1:]))
    return torch.cat([rows_of_step, zero])[batch.rows]


def causal_conv_padded(x: torch.Tensor, windows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       batch: PaddedBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The batch's depthwise causal convolutions. x [B, L, C] (padded), windows [B, K - 1, C] (each sequence's
    previous inputs). Returns the outputs [B, L, C], the windows after each sequence's last real token and the window
    after each cut [num_cuts, K - 1, C]."""
    full = torch.cat([windows, x], dim=1)  # [B, K - 1 + L, C]
    taps, t, k = weight.shape[-1], x.shape[1], windows.shape[1]
    kernel = weight.reshape(weight.shape[0], taps)
    out = full[:, 0:t] * kernel[:, 0]
    for j in range(1, taps):
        out.addcmul_(full[:, j:j + t], kernel[:, j])
    if bias is not None:
        out += bias
    span = torch.arange(k, device=x.device)
    after = full[torch.arange(full.shape[0], device=x.device)[:, None], batch.lens[:, None] + span]
    at_cuts = full[batch.cut_batch[:, None], batch.cut_lens[:, None] + span]
    return out, after, at_cuts
