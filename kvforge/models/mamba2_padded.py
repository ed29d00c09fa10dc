"""The Mamba-2 SSD scan over a padded batch of short sequences (models/state_batch.py): one segment, all at once.

The same quadratic (attention-like) form as `mamba2_mixer.ssd_scan`, with a batch dimension in front. Padding
places come with dt = 0: no decay and no input, so each sequence's state after the batch is its state after its
last real token. A checkpoint cut's state is its sequence's start state decayed plus its inputs up to the cut (one
cut at a time, each its own tensor: a checkpoint keeps only itself alive), a cut at the end a copy of the state.
A batch of one-token sequences takes `recurrent_step`, the recurrence itself.
"""
from __future__ import annotations

import torch


def _shared(v: torch.Tensor) -> bool:
    """B or C [B, L, H, N] given as one group broadcast over the heads (stride 0 over H)."""
    return v.stride(2) == 0


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
                    state: torch.Tensor, lens: list[int], cut_at: list[tuple[int, int]]
                    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """x [B, L, H, P], dt [B, L, H] (discretized; 0 at padding: its rows read a zero row), a [H] (negative), b, c [B, L, H, N], state
    [B, H, P, N] updated in place to each sequence's state after the batch (lens[z] tokens of sequence z). Returns
    y [B, L, H, P] (without D) and, for each (z, k) of cut_at, sequence z's state after k tokens [H, P, N]."""
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
    cuts: list[torch.Tensor | None] = [None] * len(cut_at)
    for j, (z, k) in enumerate(cut_at):  # a cut inside a sequence: its start state decayed plus its inputs so far
        if k < lens[z]:
            weights = torch.exp(cum[z, k - 1][None, :] - cum[z, :k])[None]
            cuts[j] = _states_in(weights, xdt[z:z + 1, :k], b[z:z + 1, :k])[0].addcmul_(
                state[z], torch.exp(cum[z, k - 1])[:, None, None])
    to_end = torch.exp(cum[:, -1:, :] - cum)  # [B, L, H]
    state.mul_(torch.exp(cum[:, -1])[:, :, None, None]).add_(_states_in(to_end, xdt, b))
    for j, (z, k) in enumerate(cut_at):
        if k == lens[z]:
            cuts[j] = state[z].clone()
    return y, cuts


def recurrent_step(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                   state: torch.Tensor) -> torch.Tensor:
    """One token of each sequence: x [B, 1, H, P], dt [B, 1, H], b, c [B, 1, H, N], state [B, H, P, N] updated in
    place (decayed, plus x dt b, in two passes over it). Returns y [B, 1, H, P] (without D)."""
    xdt = x[:, 0] * dt[:, 0, :, None]  # [B, H, P]
    state.mul_(torch.exp(dt[:, 0] * a)[:, :, None, None]).addcmul_(xdt[..., None], b[:, 0, :, None, :])
    return _read_state(c, state)
