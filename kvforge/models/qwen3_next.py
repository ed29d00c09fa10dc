"""Qwen3-Next (Qwen3NextForCausalLM): gated delta net layers (linear attention with a decaying, delta-rule updated
state; Yang et al. 2024, "Gated Delta Networks") and a few gated full-attention layers (QK-norm, partial RoPE, the
output gated by a sigmoid of a second query projection); MoE with a sigmoid-gated shared expert (a plain torch
loop over the experts hit); RMSNorms scale by 1 + w.

A delta net layer's state per sequence, in the engine's state pool: the last conv_kernel - 1 inputs of its causal
convolution over q, k, v [K - 1, conv_dim] and its recurrent state [value heads, key dim, value dim]. The delta rule
runs token by token (as transformers' recurrent form), so chunking cannot change it. Parameter names follow
Hugging Face (per-expert `mlp.experts.{i}.*` as saved).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.attention import AttentionMetadata, attend
from kvforge.kv.pool import KVPool
from kvforge.models.config import ModelConfig
from kvforge.models.layers import RotaryEmbedding
from kvforge.models.mamba2_mixer import causal_conv
from kvforge.rope import apply_rope


class OffsetRMSNorm(nn.Module):
    """RMSNorm scaling by (1 + w)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


class GatedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, kv_layer: int):
        super().__init__()
        self.layer_idx, self.heads, self.kv_heads, self.head_dim = kv_layer, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.rotary_dim = cfg.extra["rotary_dim"]
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, 2 * cfg.num_heads * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = OffsetRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r = self.rotary_dim
        return torch.cat([apply_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)

    def forward(self, x, cos, sin, meta: AttentionMetadata, kv: KVPool) -> torch.Tensor:
        t = x.shape[0]
        q, gate = self.q_proj(x).view(t, self.heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self._rope(self.q_norm(q), cos, sin)
        k = self._rope(self.k_norm(self.k_proj(x).view(t, self.kv_heads, self.head_dim)), cos, sin).contiguous()
        v = self.v_proj(x).view(t, self.kv_heads, self.head_dim)
        kv.write(self.layer_idx, meta, k, v)
        out = attend(q.contiguous(), kv.layers[self.layer_idx], meta.for_layer(self.layer_idx), self.head_dim**-0.5)
        return self.o_proj(out.reshape(t, -1) * torch.sigmoid(gate.reshape(t, -1)))


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_rule(q, k, v, g, beta, state, cuts) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """One sequence, token by token. q, k [T, H, Dk] (l2-normed, q scaled), v [T, H, Dv], g, beta [T, H];
    state [H, Dk, Dv] updated in place; copies after `cuts` tokens."""
    out, saved = torch.empty_like(v), {}
    for t in range(q.shape[0]):
        state.mul_(g[t].exp()[:, None, None])
        delta = (v[t] - (state * k[t][..., None]).sum(dim=-2)) * beta[t][:, None]
        state.add_(k[t][..., None] * delta[:, None, :])
        out[t] = (state * q[t][..., None]).sum(dim=-2)
        if t + 1 in cuts:
            saved[t + 1] = state.clone()
    return out, saved


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        x = cfg.extra
        self.layer_idx = layer_idx
        self.nv, self.nk, self.dk, self.dv = (x["linear_num_value_heads"], x["linear_num_key_heads"],
                                              x["linear_key_head_dim"], x["linear_value_head_dim"])
        self.key_dim, self.value_dim = self.nk * self.dk, self.nv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        kernel = x["linear_conv_kernel_dim"]
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, kernel, groups=self.conv_dim, bias=False,
                                padding=kernel - 1)
        self.in_proj_qkvz = nn.Linear(cfg.hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(cfg.hidden_size, 2 * self.nv, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.nv))
        self.A_log = nn.Parameter(torch.zeros(self.nv))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(self.dv))
        self.eps = cfg.rms_norm_eps
        self.out_proj = nn.Linear(self.value_dim, cfg.hidden_size, bias=False)

    def _split(self, h: torch.Tensor):
        """q, k, v, z, b, a from the projections, laid out per key head as transformers orders them."""
        t, per = h.shape[0], self.nv // self.nk
        qkvz = self.in_proj_qkvz(h).view(t, self.nk, 2 * self.dk + 2 * per * self.dv)
        q, k, v, z = qkvz.split([self.dk, self.dk, per * self.dv, per * self.dv], dim=-1)
        b, a = self.in_proj_ba(h).view(t, self.nk, 2 * per).split([per, per], dim=-1)
        return (q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1), z.reshape(t, self.nv, self.dv),
                b.reshape(t, self.nv), a.reshape(t, self.nv))

    def forward(self, h: torch.Tensor, meta: AttentionMetadata, kv: KVPool) -> torch.Tensor:
        states = kv.state.layer(self.layer_idx)
        q, k, v, z, b, a = self._split(h)
        mixed = torch.cat([q, k, v], dim=-1)
        beta, g = b.sigmoid(), -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        rep = self.nv // self.nk
        out = torch.empty(h.shape[0], self.nv, self.dv, dtype=h.dtype, device=h.device)
        for i, (start, n, slot) in enumerate(zip(meta.query_start_loc, meta.query_lens, meta.state_slots)):
            rows, cuts = slice(start, start + n), meta.state_cuts[i] if meta.state_cuts else []
            conv, windows = causal_conv(mixed[rows], states["conv"][slot], self.conv1d.weight, None, cuts)
            qs, ks, vs = F.silu(conv).split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
            qs = l2norm(qs.reshape(n, self.nk, self.dk)).repeat_interleave(rep, dim=1) / self.dk**0.5
            ks = l2norm(ks.reshape(n, self.nk, self.dk)).repeat_interleave(rep, dim=1)
            out[rows], saved = gated_delta_rule(qs, ks, vs.reshape(n, self.nv, self.dv), g[rows], beta[rows],
                                                states["delta"][slot], cuts)
            for cut in cuts:
                kv.state.capture(i, cut, self.layer_idx, {"conv": windows[cut], "delta": saved[cut]})
        normed = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm.weight
        return self.out_proj((normed * F.silu(z)).reshape(h.shape[0], -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        x = cfg.extra
        self.top_k, self.norm_topk = x["num_experts_per_tok"], x["norm_topk_prob"]
        self.gate = nn.Linear(cfg.hidden_size, x["num_experts"], bias=False)
        self.experts = nn.ModuleList(MLP(cfg.hidden_size, x["moe_intermediate_size"]) for _ in range(x["num_experts"]))
        self.shared_expert = MLP(cfg.hidden_size, x["shared_expert_intermediate_size"])
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float)
        top, index = probs.topk(self.top_k, dim=-1)
        if self.norm_topk:
            top = top / top.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in index.unique().tolist():
            rows, k = torch.where(index == e)
            out.index_add_(0, rows, self.experts[e](x[rows]) * top[rows, k, None].to(x.dtype))
        return out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class Qwen3NextLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        x = cfg.extra
        if layer in cfg.attention_layers:
            self.self_attn = GatedAttention(cfg, cfg.attention_layers.index(layer))
        else:
            self.linear_attn = GatedDeltaNet(cfg, layer)
        moe = layer not in x["mlp_only_layers"] and x["num_experts"] > 0 and (layer + 1) % x["decoder_sparse_step"] == 0
        self.mlp = SparseMoE(cfg) if moe else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, meta, kv):
        h = self.input_layernorm(x)
        h = self.self_attn(h, cos, sin, meta, kv) if hasattr(self, "self_attn") else self.linear_attn(h, meta, kv)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3NextModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen3NextLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3NextForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Qwen3NextModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.extra["rotary_dim"], cfg.rope_theta, cfg.rope_scaling)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_buffers(self) -> None:
        cfg = self.config
        self.rotary = RotaryEmbedding(cfg.extra["rotary_dim"], cfg.rope_theta, cfg.rope_scaling)

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv: KVPool) -> torch.Tensor:
        cos, sin = self.rotary.cos_sin(meta.positions)
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin, meta, kv)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
