"""In-place placement of a kept set: kept rows below a bound stay at their cache index, the others fill the gaps.

A compaction moves row keep[..., j] to cache index j. Packing the kept rows in order shifts every row behind the
first dropped one, so under a format whose blocks share parameters (int4 / kivi2 keys per channel) nearly every
block is regrouped and encoded again from its decoded rows at every compaction, and a row that stays for long is
rounded again each time. Placed in place, only the blocks that lost a row take new rows; the others keep their codes.
"""
from __future__ import annotations

import torch


def in_place(kept: torch.Tensor, stay_below: int) -> torch.Tensor:
    """kept: sorted cache indices [..., m] (a kept set per leading index) -> the same indices as a placement: each
    kept index below `stay_below` (<= m) at its own position, the others (in order) at the positions left free.
    (A block the new tokens will fill, past the last whole one, then takes the newest rows.)"""
    m = kept.shape[-1]
    bound = min(stay_below, m)
    stays = kept < bound
    present = torch.zeros(*kept.shape[:-1], m + 1, dtype=torch.bool)
    present.scatter_(-1, torch.where(stays, kept, m), True)
    out = torch.arange(m).expand_as(kept).clone()
    out[~present[..., :m]] = kept[~stays]  # both in row-major order: each leading index's gaps take its own rows
    return out
