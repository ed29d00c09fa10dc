"""Multi-head Latent Attention (MLA; DeepSeek-V2, arXiv:2405.04434) over a paged latent cache.

Each token caches one row per layer: the compressed latent c_kv (kv_lora_rank, after
kv_a_layernorm) followed by the shared rotary key k_rope (qk_rope_head_dim, after RoPE).

Attention always runs in the absorbed form. With kv_b_proj split per head into W_UK
[nope, rank] and W_UV [v, rank]:
    score(q, t) = (q_nope W_UK) . c_kv[t] + q_rope . k_rope[t] = [q_nope W_UK, q_rope] . row[t]
    out         = (sum_t p_t c_kv[t]) W_UV^T
so attention is multi-query attention whose single key is the cached row and whose value is
its c_kv part; per-head keys and values are never materialised for cached tokens.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.attention import AttentionMetadata, prefill_history
from kvforge.errors import ModelLoadError
from kvforge.kv.layer_format import LayerKV
from kvforge.kv.policies.stats import record_decode, record_prefill, reduce_query_heads
from kvforge.kv.pool import KVPool
from kvforge.models.config import ModelConfig
from kvforge.models.int8_weights import linear
from kvforge.models.layers import RMSNorm

LATENT_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm use the default eps, not rms_norm_eps


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _rope_kind(scaling: dict | None) -> str:
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))


def yarn_inv_freq(dim: int, theta: float, scaling: dict, max_pos: int) -> tuple[torch.Tensor, float]:
    """YaRN inverse frequencies and the cos/sin magnitude factor (arXiv:2309.00071)."""
    orig = scaling.get("original_max_position_embeddings") or max_pos
    factor = scaling.get("factor") or max_pos / orig
    attn = scaling.get("attention_factor")
    mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attn is None:
        attn = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all) if mscale and mscale_all else _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * (1 - ramp)
    return inv_freq, float(attn)


def mla_softmax_scale(cfg: ModelConfig) -> float:
    scale = (cfg.extra["qk_nope_head_dim"] + cfg.extra["qk_rope_head_dim"]) ** -0.5
    scaling = cfg.rope_scaling or {}
    if _rope_kind(scaling) != "default" and scaling.get("mscale_all_dim"):
        scale *= _yarn_mscale(scaling.get("factor") or 1.0, scaling["mscale_all_dim"]) ** 2
    return scale


class MLARotary(nn.Module):
    """RoPE on the rotary part of q and k; pairs are (x[2i], x[2i+1]) when interleaved, else (x[i], x[i+d/2])."""

    def __init__(self, dim: int, theta: float, scaling: dict | None, max_pos: int, interleave: bool):
        super().__init__()
        kind = _rope_kind(scaling)
        if kind == "default":
            inv_freq, self.attention_factor = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)), 1.0
        elif kind == "yarn":
            inv_freq, self.attention_factor = yarn_inv_freq(dim, theta, scaling, max_pos)
        else:
            raise ModelLoadError(f"DeepSeek rope_scaling type {kind!r} is not supported; supported: default, yarn")
        self.interleave = interleave
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of each pair's angle, [T, dim/2], scaled by the YaRN attention factor."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, dim]. The output lists rotated first halves, then second halves (same for q and k)."""
        x1, x2 = (x[..., 0::2], x[..., 1::2]) if self.interleave else x.chunk(2, dim=-1)
        return _rotate(x1, x2, cos, sin)

    def rerotate(self, rows: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        """Cached rows [T, 1, rank + rope] whose k_rope was rotated at p, re-rotated to p + shift (for compaction)."""
        dim = 2 * self.inv_freq.shape[0]
        freqs = shift.to(rows.device).float()[:, None] * self.inv_freq[None, :]
        x1, x2 = rows[..., -dim:].chunk(2, dim=-1)  # apply() stores halves whatever the input layout
        return torch.cat((rows[..., :-dim], _rotate(x1, x2, freqs.cos(), freqs.sin())), dim=-1)


def _rotate(x1: torch.Tensor, x2: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    c, s = cos[:, None, :].to(x1.dtype), sin[:, None, :].to(x1.dtype)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


class MLAAttention(nn.Module):
    """Hugging Face DeepseekV2/V3 attention parameters; the cache holds [c_kv, k_rope] per token."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        e = cfg.extra
        self.layer_idx, self.num_heads = layer_idx, cfg.num_heads
        self.q_lora_rank, self.kv_lora_rank = e.get("q_lora_rank"), int(e["kv_lora_rank"])
        self.nope_dim, self.rope_dim, self.v_dim = int(e["qk_nope_head_dim"]), int(e["qk_rope_head_dim"]), int(e["v_head_dim"])
        qk_dim, hidden, bias = self.nope_dim + self.rope_dim, cfg.hidden_size, cfg.attention_bias
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, self.num_heads * qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(self.q_lora_rank, self.num_heads * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, hidden, bias=bias)
        self.scale = mla_softmax_scale(cfg)

    def linear_weights(self) -> list[torch.Tensor]:
        """The weights this module multiplies through ops `linear` (kv_b_proj's are absorbed per head instead)."""
        query = [self.q_proj] if self.q_lora_rank is None else [self.q_a_proj, self.q_b_proj]
        return [lin.weight for lin in (*query, self.kv_a_proj_with_mqa, self.o_proj)]

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if self.q_lora_rank is None:
            return _linear(x, self.q_proj)
        return _linear(self.q_a_layernorm(_linear(x, self.q_a_proj)), self.q_b_proj)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary: MLARotary,
                meta: AttentionMetadata, kv: KVPool) -> torch.Tensor:
        t, h = x.shape[0], self.num_heads
        q_nope, q_rope = self._query(x).view(t, h, -1).split([self.nope_dim, self.rope_dim], dim=-1)
        c_kv, k_rope = _linear(x, self.kv_a_proj_with_mqa).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        q_rope = rotary.apply(q_rope, cos, sin)
        k_rope = rotary.apply(k_rope[:, None, :], cos, sin)
        kv.write(self.layer_idx, meta, torch.cat((self.kv_a_layernorm(c_kv)[:, None, :], k_rope), dim=-1), None)
        w = self.kv_b_proj.weight.view(h, self.nope_dim + self.v_dim, self.kv_lora_rank)
        w_uk, w_uv = w[:, : self.nope_dim], w[:, self.nope_dim :]
        q_latent = torch.einsum("thn,hnr->thr", q_nope, w_uk)
        out_latent = attend_latent(torch.cat((q_latent, q_rope), dim=-1), kv.layers[self.layer_idx], meta.for_layer(self.layer_idx),
                                   self.scale, self.kv_lora_rank)
        out = torch.einsum("thr,hvr->thv", out_latent, w_uv)
        return _linear(out.reshape(t, h * self.v_dim), self.o_proj)


def _linear(x: torch.Tensor, lin: nn.Linear) -> torch.Tensor:
    return linear(x, lin.weight, lin.bias)


def attend_latent(q: torch.Tensor, cache: LayerKV, meta: AttentionMetadata, scale: float, rank: int) -> torch.Tensor:
    """q: [T, heads, rank + rope] absorbed queries -> [T, heads, rank] attention-weighted latents.

    Scores are exactly those of the unabsorbed attention, so KV policies get them (meta.stats) unchanged.
    """
    out = q.new_empty(q.shape[0], q.shape[1], rank)
    for seqs, table, valid, q_index, _ in meta.decode_groups(q.device):
        b, width = table.shape
        rows = cache.gather(table.flatten())[0].view(b, width * meta.block_size, -1).to(q.dtype)
        scores = torch.bmm(q[q_index], rows.transpose(1, 2)) * scale  # [B, heads, L]
        probs = torch.softmax(scores.masked_fill_(~valid[:, None, :], float("-inf")), dim=-1)
        out[q_index] = torch.bmm(probs, rows[..., :rank])
        if meta.stats:
            record_decode(meta.stats, seqs, reduce_query_heads(meta.stats, probs, 1), meta.context_lens)
    for i in meta.multi_rows + meta.prefill_rows:
        start, n = meta.query_start_loc[i], meta.query_lens[i]
        rows, _, mask = prefill_history(cache, meta, i, q.device)  # rows: [1, 1, ctx, rank + rope]
        rows = rows.to(q.dtype)
        res = F.scaled_dot_product_attention(q[start : start + n].transpose(0, 1)[None], rows, rows[..., :rank],
                                             attn_mask=mask, scale=scale, enable_gqa=True)
        out[start : start + n] = res[0].transpose(0, 1)
        if meta.stats:
            record_prefill(meta.stats, i, q[start : start + n], rows, mask, scale)
    return out
