"""Liquid LFM2 (Lfm2ForCausalLM): gated short-convolution layers and a few attention layers (QK-norm, RoPE), each
followed by a SwiGLU MLP; the final norm is called `embedding_norm`.

A short conv layer computes out_proj(C * conv(B * x)) with a depthwise causal convolution of `conv_L_cache` taps; its
state per sequence is the last conv_L_cache - 1 values of B * x [L - 1, hidden] (the engine's state pool). Attention
layers keep paged KV (KV layer i is model layer `attention_layers[i]`). Parameter names follow Hugging Face.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.attention import AttentionMetadata, attend
from kvforge.kv.pool import KVPool
from kvforge.models.config import ModelConfig
from kvforge.models.layers import RMSNorm, RotaryEmbedding
from kvforge.models.mamba2_mixer import causal_conv
from kvforge.models.state_batch import causal_conv_padded, padded, step_plan
from kvforge.ops.layers import rope


class Lfm2Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, kv_layer: int):
        super().__init__()
        self.layer_idx, self.heads, self.kv_heads, self.head_dim = kv_layer, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.out_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.q_layernorm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_layernorm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, meta: AttentionMetadata, kv: KVPool) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_layernorm(self.q_proj(x).view(t, self.heads, self.head_dim))
        k = self.k_layernorm(self.k_proj(x).view(t, self.kv_heads, self.head_dim))
        v = self.v_proj(x).view(t, self.kv_heads, self.head_dim)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        kv.write(self.layer_idx, meta, k, v)
        out = attend(q, kv.layers[self.layer_idx], meta.for_layer(self.layer_idx), self.head_dim**-0.5)
        return self.out_proj(out.reshape(t, -1))


class ShortConv(nn.Module):
    def __init__(self, hidden: int, kernel: int, bias: bool, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.conv = nn.Conv1d(hidden, hidden, kernel, groups=hidden, bias=bias, padding=kernel - 1)
        self.in_proj = nn.Linear(hidden, 3 * hidden, bias=bias)
        self.out_proj = nn.Linear(hidden, hidden, bias=bias)

    def forward(self, h: torch.Tensor, meta: AttentionMetadata, kv: KVPool) -> torch.Tensor:
        windows = kv.state.layer(self.layer_idx)["conv"]
        b, c, x = self.in_proj(h).chunk(3, dim=-1)
        bx, out = b * x, torch.empty_like(x)
        plan = step_plan(meta, h.device)
        for batch in plan.batches:  # one conv per padded batch of short sequences (models/state_batch.py)
            conv, after, at_cuts = causal_conv_padded(padded(bx, batch), batch.gather(windows), self.conv.weight,
                                                      self.conv.bias, batch)
            batch.scatter(windows, after)
            out.index_copy_(0, batch.flat_rows, conv.reshape(-1, conv.shape[-1])[batch.valid.reshape(-1)])
            for j, (i, cut) in enumerate(batch.cut_ids):
                kv.state.capture(i, cut, self.layer_idx, {"conv": at_cuts[j].clone()})
        for i in plan.singles:
            start, n, slot = meta.query_start_loc[i], meta.query_lens[i], meta.state_slots[i]
            cuts = meta.state_cuts[i] if meta.state_cuts else []
            out[start:start + n], saved = causal_conv(bx[start:start + n], windows[slot], self.conv.weight,
                                                      self.conv.bias, cuts)
            for cut in cuts:
                kv.state.capture(i, cut, self.layer_idx, {"conv": saved[cut]})
        return self.out_proj(c * out)


class Lfm2MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, intermediate, bias=False)
        self.w3 = nn.Linear(hidden, intermediate, bias=False)
        self.w2 = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Lfm2Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        if layer in cfg.attention_layers:
            self.self_attn = Lfm2Attention(cfg, cfg.attention_layers.index(layer))
        else:
            self.conv = ShortConv(cfg.hidden_size, cfg.extra["conv_L_cache"], cfg.extra["conv_bias"], layer)
        self.feed_forward = Lfm2MLP(cfg.hidden_size, cfg.intermediate_size)
        self.operator_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, meta, kv):
        h = self.operator_norm(x)
        x = x + (self.self_attn(h, cos, sin, meta, kv) if hasattr(self, "self_attn") else self.conv(h, meta, kv))
        return x + self.feed_forward(self.ffn_norm(x))


class Lfm2Model(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Lfm2Layer(cfg, i) for i in range(cfg.num_layers))
        self.embedding_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Lfm2ForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Lfm2Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_buffers(self) -> None:
        cfg = self.config
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv: KVPool) -> torch.Tensor:
        cos, sin = self.rotary.cos_sin(meta.positions)
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin, meta, kv)
        return self.model.embedding_norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
