"""Llama-family decoder (Llama, Mistral, SmolLM, Qwen2, Qwen3): MHA, GQA and MQA.

Parameter names follow Hugging Face, so checkpoints load with load_state_dict.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from kvforge.attention import AttentionMetadata, attend
from kvforge.kv.pool import KVPool
from kvforge.models.bridged import LayerNorms, bridged, forward_bridged
from kvforge.models.config import ModelConfig
from kvforge.models.int8_weights import linear
from kvforge.models.layers import GatedMLP, RMSNorm, RotaryEmbedding, fuse_linears, unfilled_embedding
from kvforge.models.quant_weights import block_data
from kvforge.ops.huge_pages import move_to_huge_pages
from kvforge.ops.layers import add_rms_norm_, rope


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, q_out, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_out, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_out, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q_out, cfg.hidden_size, bias=cfg.attention_bias and cfg.arch == "llama")
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.scale = cfg.head_dim**-0.5
        self.softcap: float | None = None  # attention logit soft-capping (Gemma 2)
        self.register_buffer("qkv_weight", None, persistent=False)
        self.register_buffer("qkv_bias", None, persistent=False)

    def fuse_projections(self) -> None:
        """q, k and v as one matmul (their parameters become views into the fused weight)."""
        self.qkv_weight, self.qkv_bias = fuse_linears(self.q_proj, self.k_proj, self.v_proj)

    def linear_weights(self) -> list[torch.Tensor | None]:
        """The weights this module multiplies through ops `linear` (models/weight_store.py gives them their layouts)."""
        return [self.qkv_weight, self.o_proj.weight]

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t, heads, kv_heads = x.shape[0], self.num_heads, self.num_kv_heads
        if self.qkv_weight is None:
            return (self.q_proj(x).view(t, heads, self.head_dim), self.k_proj(x).view(t, kv_heads, self.head_dim),
                    self.v_proj(x).view(t, kv_heads, self.head_dim))
        qkv = linear(x, self.qkv_weight, self.qkv_bias).view(t, heads + 2 * kv_heads, self.head_dim)
        return qkv.split_with_sizes([heads, kv_heads, kv_heads], dim=1)

    def forward(self, x, cos, sin, meta: AttentionMetadata, kv: KVPool) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.project_qkv(x)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        kv.write(self.layer_idx, meta, k, v)
        out = attend(q, kv.layers[self.layer_idx], meta.for_layer(self.layer_idx), self.scale, self.softcap)
        return linear(out.reshape(t, -1), self.o_proj.weight, self.o_proj.bias)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, cos, sin, meta, kv):
        """x: the previous layer's output, not yet added to the residual stream (at the first layer, residual is
        None and x the embeddings). Returns this layer's output and the stream before it; the stream is added to in
        place, each add fused with the norm that follows it."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h = add_rms_norm(residual, x, self.input_layernorm)
        h = add_rms_norm(residual, self.self_attn(h, cos, sin, meta, kv), self.post_attention_layernorm)
        return self.mlp(h), residual

    def bridge_norms(self) -> LayerNorms:
        attn = self.self_attn
        q, k = (attn.q_norm.weight, attn.k_norm.weight) if attn.qk_norm else (None, None)
        return LayerNorms(self.input_layernorm.weight, self.post_attention_layernorm.weight, None, None, q, k)


def add_rms_norm(residual: torch.Tensor, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    return add_rms_norm_(residual, x, norm.weight, norm.eps)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = unfilled_embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    use_bridge = True  # decode-sized steps through the compiled layer bridge (models/bridged.py) where it serves

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_buffers(self) -> None:
        """Recreate non-persistent buffers after loading weights onto a meta-built model."""
        cfg = self.config
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        for layer in self.model.layers:
            layer.self_attn.fuse_projections()
            layer.mlp.fuse_projections()
        move_to_huge_pages(self, block_data(self))  # a decode step streams every weight: ~1.6x the bandwidth of 4 KB pages

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv: KVPool,
                layers: Sequence[int] | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] of the flattened tokens of one step; `layers` runs only those layers
        (ascending indices), then the final norm (a layer-skip drafter)."""
        cos, sin = self.rotary.cos_sin(meta.positions)
        x, residual = self.model.embed_tokens(input_ids), None
        weights = bridged(self, x) if self.use_bridge else None
        if weights is not None:
            chosen = range(len(self.model.layers)) if layers is None else layers
            return forward_bridged(self, weights, x, [(cos, sin)] * len(self.model.layers), meta, kv, chosen)
        for layer in self.model.layers if layers is None else (self.model.layers[i] for i in layers):
            x, residual = layer(x, residual, cos, sin, meta, kv)
        return self.model.norm(x) if residual is None else add_rms_norm(residual, x, self.model.norm)

    def linear_weights(self) -> list[torch.Tensor]:
        return [self.lm_head.weight]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.lm_head.weight)
