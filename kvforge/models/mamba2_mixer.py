"""The Mamba-2 mixer (Dao & Gu 2024, "Transformers are SSMs": state space duality) over the engine's state pool.

Per sequence of a step: the causal depthwise convolution reads the last d_conv - 1 inputs from the sequence's
state slot (zeros before its first token) and leaves its own last ones there; the selective scan starts from the
slot's SSM state and leaves the state after the step's last token. So a prompt may arrive in one step, in chunks
or token by token, and a batch may mix prefills and decodes: the result is the same. The scan runs in segments of
at most SEGMENT tokens in the SSD's quadratic (attention-like) form, carrying the state between segments; where the
step asks for a checkpoint (meta.state_cuts) the state there is computed from its segment's start state and inputs
(segments are not split), and its copy goes to the state pool's captures.
Parameter names follow Hugging Face (`in_proj`, `conv1d`, `dt_bias`, `A_log`, `D`, `norm`, `out_proj`).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.models.mamba2_padded import recurrent_step, ssd_scan_padded
from kvforge.models.state_batch import PaddedBatch, causal_conv_padded, padded, step_plan
from kvforge.ops import layers as ops_layers

SEGMENT = 64


class GatedRMSNorm(nn.Module):
    """RMSNorm of y * silu(gate), per group of channels (Mamba-2's norm before out_proj)."""

    def __init__(self, size: int, group_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.group_size, self.eps = group_size, eps

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        y = y.float() * F.silu(gate.float())
        if self.group_size == y.shape[-1]:  # one group: the compiled norm, its weight multiplied in the same pass
            return ops_layers.rms_norm(y, self.weight, self.eps)
        g = y.view(*y.shape[:-1], -1, self.group_size)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * g.view_as(y)


def segments(length: int) -> list[tuple[int, int]]:
    """[start, end) pieces of at most SEGMENT tokens covering `length`."""
    ends = list(range(SEGMENT, length, SEGMENT)) + [length]
    return list(zip([0] + ends[:-1], ends))


def _shared(v: torch.Tensor) -> bool:
    """B or C given as one group broadcast over the heads (a stride-0 view): [T, N] products serve every head."""
    return v.stride(1) == 0


def _states_in(weights: torch.Tensor, xdt: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum_s weights[s, h] * xdt[s, h, p] * b[s, h, n] -> [H, P, N]."""
    wx = weights[..., None] * xdt
    if _shared(b):
        return (wx.reshape(wx.shape[0], -1).t() @ b[:, 0]).view(wx.shape[1], wx.shape[2], b.shape[2])
    return torch.einsum("shp,shn->hpn", wx, b)


def _read_state(c: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """y[t, h, p] = sum_n c[t, h, n] * state[h, p, n]."""
    if _shared(c):
        return (c[:, 0] @ state.reshape(-1, state.shape[2]).t()).view(c.shape[0], state.shape[0], state.shape[1])
    return torch.einsum("thn,hpn->thp", c, state)


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
             state: torch.Tensor, cuts: list[int] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """One sequence's scan. x [T, H, P], dt [T, H] (discretized), a [H] (negative), b, c [T, H, N] (per head; one
    group may come as a broadcast view), state [H, P, N], updated in place to the state after the last token.
    Returns y [T, H, P] (without D) and the state after each of `cuts` tokens (checkpoints): a cut inside a
    segment does not split it, its state is the segment's start state decayed plus its inputs so far."""
    out, saved = [], {}
    for s, e in segments(x.shape[0]):
        xs, dts, bs, cs = x[s:e], dt[s:e], b[s:e], c[s:e]
        length = xs.shape[0]
        cum = torch.cumsum(dts * a, dim=0)  # [L, H] log decay from the segment's start through each token
        diff = cum[:, None, :] - cum[None, :, :]  # [L(t), L(s), H]: decay from token s to token t
        causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
        decay = torch.exp(diff.masked_fill(~causal[..., None], float("-inf")))
        if _shared(bs) and _shared(cs):
            scores = (cs[:, 0] @ bs[:, 0].t())[..., None] * decay  # [L, L, H]
        else:
            scores = torch.einsum("thn,shn->tsh", cs, bs) * decay
        xdt = xs * dts[..., None]  # [L, H, P]
        y = torch.einsum("tsh,shp->thp", scores, xdt)
        y = y + _read_state(cs, state) * torch.exp(cum)[..., None]
        for cut in (c_ for c_ in cuts if s < c_ < e):
            k = cut - s
            saved[cut] = _states_in(torch.exp(cum[k - 1][None, :] - cum[:k]), xdt[:k], bs[:k]).addcmul_(
                state, torch.exp(cum[k - 1])[:, None, None])  # one pass over the state, no temporary
        to_end = torch.exp(cum[-1][None, :] - cum)  # [L, H]
        state.mul_(torch.exp(cum[-1])[:, None, None]).add_(_states_in(to_end, xdt, bs))
        out.append(y)
        if e in cuts:
            saved[e] = state.clone()
    return torch.cat(out), saved


def causal_conv(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                cuts: list[int] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """One sequence's depthwise causal convolution. x [T, C]; window [K - 1, C], the previous inputs, replaced in
    place by the last K - 1 inputs. Returns [T, C] and a copy of the window after each of `cuts` tokens."""
    full = torch.cat([window, x])  # [K - 1 + T, C]
    taps, t = weight.shape[-1], x.shape[0]
    kernel = weight.reshape(weight.shape[0], taps)
    out = full[0:t] * kernel[:, 0]  # the depthwise convolution as K shifted multiply-adds on contiguous rows
    for j in range(1, taps):
        out.addcmul_(full[j:j + t], kernel[:, j])
    if bias is not None:
        out += bias
    k = window.shape[0]
    saved = {cut: full[cut:cut + k].clone() for cut in cuts}
    window.copy_(full[full.shape[0] - k:])
    return out, saved


class Mamba2Mixer(nn.Module):
    def __init__(self, hidden_size: int, mamba: dict[str, Any], layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.head_dim, self.d_state = mamba["n_heads"], mamba["head_dim"], mamba["d_state"]
        self.n_groups, self.intermediate = mamba["n_groups"], mamba["intermediate"]
        self.time_step_limit = mamba["time_step_limit"]
        self.conv_dim = self.intermediate + 2 * self.n_groups * self.d_state
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, mamba["d_conv"], groups=self.conv_dim,
                                bias=mamba["conv_bias"], padding=mamba["d_conv"] - 1)
        self.in_proj = nn.Linear(hidden_size, self.intermediate + self.conv_dim + self.n_heads, bias=mamba["proj_bias"])
        self.dt_bias = nn.Parameter(torch.ones(self.n_heads))
        self.A_log = nn.Parameter(torch.zeros(self.n_heads))
        self.D = nn.Parameter(torch.ones(self.n_heads))
        self.norm = GatedRMSNorm(self.intermediate, self.intermediate // self.n_groups, mamba["norm_eps"])
        self.out_proj = nn.Linear(self.intermediate, hidden_size, bias=mamba["proj_bias"])

    def _per_head(self, v: torch.Tensor, rep: int) -> torch.Tensor:
        """[T, groups, N] -> [T, heads, N]: each group's B or C for its heads (one group: a broadcast view)."""
        return v.expand(v.shape[0], rep, v.shape[2]) if self.n_groups == 1 else v.repeat_interleave(rep, dim=1)

    def _run_batch(self, batch: PaddedBatch, xbc: torch.Tensor, dt: torch.Tensor, a: torch.Tensor,
                   states: dict[str, torch.Tensor], out: torch.Tensor, kv) -> None:
        """A padded batch of the step's short sequences (models/state_batch.py): their conv windows and SSM states
        gathered by slot, one conv and one scan, the states scattered back and each cut's copy captured."""
        size, length = batch.valid.shape
        conv, windows, window_cuts = causal_conv_padded(padded(xbc, batch), batch.gather(states["conv"]),
                                                        self.conv1d.weight, self.conv1d.bias, batch)
        batch.scatter(states["conv"], windows)
        x, b, c = F.silu(conv).split([self.intermediate, self.n_groups * self.d_state, self.n_groups * self.d_state], -1)
        x = x.reshape(size, length, self.n_heads, self.head_dim)
        rep = self.n_heads // self.n_groups
        b, c = (v.reshape(size, length, self.n_groups, self.d_state) for v in (b, c))
        b, c = ((v.expand(size, length, rep, self.d_state) if self.n_groups == 1 else v.repeat_interleave(rep, dim=2))
                for v in (b, c))
        ssm = batch.gather(states["ssm"])
        if length == 1:  # decodes: the recurrence, a cut (at 1) a copy of the state after it
            y = recurrent_step(x, padded(dt, batch), a, b, c, ssm)
            ssm_cuts = [ssm[z].clone() for z, _ in batch.cut_at]
        else:
            y, ssm_cuts = ssd_scan_padded(x, padded(dt, batch), a, b, c, ssm, batch.lens_list, batch.cut_at)
        batch.scatter(states["ssm"], ssm)
        y = (y + self.D[:, None] * x).reshape(size * length, self.intermediate)[batch.valid.reshape(-1)]
        out.index_copy_(0, batch.flat_rows, y.to(out.dtype))
        for j, (i, cut) in enumerate(batch.cut_ids):
            kv.state.capture(i, cut, self.layer_idx, {"conv": window_cuts[j].clone(), "ssm": ssm_cuts[j]})

    def forward(self, h: torch.Tensor, meta, kv) -> torch.Tensor:
        """h [T, hidden] of the step's sequences back to back (meta.query_start_loc / query_lens), each reading and
        updating its slot meta.state_slots[i] of this layer's state in kv.state."""
        states = kv.state.layer(self.layer_idx)
        gate, xbc, dt = self.in_proj(h).split([self.intermediate, self.conv_dim, self.n_heads], dim=-1)
        dt = F.softplus(dt + self.dt_bias).clamp(*self.time_step_limit)
        a = -torch.exp(self.A_log.float())
        rep = self.n_heads // self.n_groups
        out = torch.empty(h.shape[0], self.intermediate, dtype=h.dtype, device=h.device)
        plan = step_plan(meta, h.device)
        for batch in plan.batches:
            self._run_batch(batch, xbc, dt, a, states, out, kv)
        for i in plan.singles:
            start, n, slot = meta.query_start_loc[i], meta.query_lens[i], meta.state_slots[i]
            rows, cuts = slice(start, start + n), meta.state_cuts[i] if meta.state_cuts else []
            conv, windows = causal_conv(xbc[rows], states["conv"][slot], self.conv1d.weight, self.conv1d.bias, cuts)
            x, b, c = F.silu(conv).split([self.intermediate, self.n_groups * self.d_state, self.n_groups * self.d_state], -1)
            x = x.reshape(n, self.n_heads, self.head_dim)
            b, c = (self._per_head(v.reshape(n, self.n_groups, self.d_state), rep) for v in (b, c))
            y, ssms = ssd_scan(x, dt[rows], a, b, c, states["ssm"][slot], cuts)
            out[rows] = (y + self.D[:, None] * x).reshape(n, self.intermediate)
            for cut in cuts:
                kv.state.capture(i, cut, self.layer_idx, {"conv": windows[cut], "ssm": ssms[cut]})
        return self.out_proj(self.norm(out, gate))
