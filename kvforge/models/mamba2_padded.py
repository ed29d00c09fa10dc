"""The Mamba-2 SSD scan over a padded batch of short sequences (models/state_batch.py): one segment, all at once.

The same quadratic (attention-like) form as `mamba2_mixer.ssd_scan`, with a batch dimension in front. Padding
places come with dt = 0: no decay and no input, so each sequence's state after the batch is its state after its
last real token. A checkpoint cut's state is its sequence's start state decayed plus its inputs up to the cut,
every cut of the batch in one pass.
"""
from __future__ import annotations

import torch


def _shared(v: torch.Tensor) -> bool:
    """B or C [B, L, H, N] given as one group broadcast over the heads (stride 0 over H)."""
    return v.stride(2) == 0


def _take(v: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """v[index] along the batch, keeping a broadcast over the heads a broadcast."""
    if _shared(v):
        return v[:, :, :1][index].expand(index.shape[0], *v.shape[1:])
    return v[index]


def _states_in(weights: torch.Tensor, xdt: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum_s weights[z, s, h] * xdt[z, s, h, p] * b[z, s, h, n] -> [Z, H, P, N]."""
    wx = weights[..., None] * xdt
    z, length, heads, dim = wx.shape
    if _shared(b):
        return (wx.reshape(z, length, heads * dim).transpose(1, 2) @ b[:, :, 0]).view(z, heads, dim, b.shape[-1])
    return torch.einsum("zshp,zshn->zhpn", wx, b)


def _read_state(c: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """y[z, t, h, p] = sum_n c[z, t, h, n] * state[z, h, p, n]."""
    z, heads, dim, n = state.shape
    if _shared(c):
        return (c[:, :, 0] @ state.reshape(z, heads * dim, n).transpose(1, 2)).view(z, c.shape[1], heads, dim)
    return torch.einsum("zthn,zhpn->zthp", c, state)


def ssd_scan_padded(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                    state: torch.Tensor, cut_batch: torch.Tensor, cut_lens: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, L, H, P], dt [B, L, H] (discretized; 0 at padding: its rows read a zero row), a [H] (negative), b, c [B, L, H, N], state
    [B, H, P, N] updated in place to each sequence's state after the batch. Returns y [B, L, H, P] (without D) and
    the state after cut_lens[i] tokens of sequence cut_batch[i], [num_cuts, H, P, N]."""
    length = x.shape[1]
    cum = torch.cumsum(dt * a, dim=1)  # [B, L, H] log decay from the start through each token
    causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
    diff = cum[:, :, None, :] - cum[:, None, :, :]  # [B, L(t), L(s), H]: decay from token s to token t
    decay = torch.exp(diff.masked_fill(~causal[None, :, :, None], float("-inf")))
    if _shared(b) and _shared(c):
        scores = (c[:, :, 0] @ b[:, :, 0].transpose(1, 2))[..., None] * decay  # [B, L, L, H]
    else:
        scores = torch.einsum("bthn,bshn->btsh", c, b) * decay
    xdt = x * dt[..., None]  # [B, L, H, P]
    y = torch.einsum("btsh,bshp->bthp", scores, xdt)
    y += _read_state(c, state) * torch.exp(cum)[..., None]
    cuts = state.new_empty((0, *state.shape[1:]))
    if cut_batch.numel():
        cum_c = cum[cut_batch]  # [C, L, H]
        last = cum_c[torch.arange(cut_batch.shape[0], device=x.device), cut_lens - 1]  # [C, H]
        before = torch.arange(length, device=x.device)[None, :] < cut_lens[:, None]  # [C, L]
        weights = torch.exp((last[:, None, :] - cum_c).masked_fill(~before[..., None], float("-inf")))
        cuts = _states_in(weights, xdt[cut_batch], _take(b, cut_batch)).addcmul_(
            state[cut_batch], torch.exp(last)[:, :, None, None])
    to_end = torch.exp(cum[:, -1:, :] - cum)  # [B, L, H]
    state.mul_(torch.exp(cum[:, -1])[:, :, None, None]).add_(_states_in(to_end, xdt, b))
    return y, cuts
