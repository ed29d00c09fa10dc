"""Gemma 2 and Gemma 3 text decoders.

Differences from Llama: embeddings scaled by sqrt(hidden), RMSNorm weights stored as an offset from 1,
norms after attention and after the MLP as well as before, a GELU-tanh gated MLP, queries scaled by
query_pre_attn_scalar, optional soft-capping of the attention scores (Gemma 2; those layers attend on the torch
path) and of the final logits, and (Gemma 3) QK-norm plus a separate RoPE
base for sliding-window layers. Attention goes through llama.py's Attention, so the per-layer window comes from
the same metadata as for every other model. Parameter names follow Hugging Face.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.attention import AttentionMetadata
from kvforge.kv.pool import KVPool
from kvforge.models.config import ModelConfig
from kvforge.models.layers import GatedMLP, RMSNorm, RotaryEmbedding, unfilled_embedding
from kvforge.models.llama import Attention


class GemmaRMSNorm(RMSNorm):
    """RMSNorm whose stored weight w scales by (1 + w)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return (x * torch.rsqrt(var + self.eps)) * (1.0 + self.weight)


class GeluGatedMLP(GatedMLP):
    """down(gelu_tanh(gate(x)) * up(x)): Llama's gated MLP with Gemma's activation."""

    def linear_weights(self) -> list[torch.Tensor]:
        return []  # its nn.Linear layers run F.linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class GemmaAttention(Attention):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        if cfg.qk_norm:
            self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.scale = float(cfg.extra.get("query_pre_attn_scalar", cfg.head_dim)) ** -0.5
        self.softcap = cfg.extra.get("attn_logit_softcapping") or None


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.sliding = cfg.layer_window(layer_idx) is not None
        self.self_attn = GemmaAttention(cfg, layer_idx)
        self.mlp = GeluGatedMLP(cfg.hidden_size, cfg.intermediate_size)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, x, rope, meta, kv):
        cos, sin = rope["local" if self.sliding else "global"]
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, meta, kv))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = unfilled_embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class GemmaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = GemmaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.embed_scale = cfg.hidden_size**0.5
        self.final_softcap = cfg.extra.get("final_logit_softcapping")
        self.init_buffers()

    def init_buffers(self) -> None:
        """Recreate non-persistent buffers after loading weights onto a meta-built model."""
        cfg = self.config
        local_theta = cfg.extra.get("rope_local_theta", cfg.rope_theta)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.rotary_local = RotaryEmbedding(cfg.head_dim, local_theta, cfg.extra.get("rope_local_scaling"))

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv: KVPool) -> torch.Tensor:
        """Hidden states [T, hidden] of the flattened tokens of one step."""
        rope = {"global": self.rotary.cos_sin(meta.positions)}
        if any(layer.sliding for layer in self.model.layers):
            rope["local"] = self.rotary_local.cos_sin(meta.positions)
        x = self.model.embed_tokens(input_ids) * torch.tensor(self.embed_scale, dtype=torch.float32).to(
            self.model.embed_tokens.weight.dtype)
        for layer in self.model.layers:
            x = layer(x, rope, meta, kv)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

