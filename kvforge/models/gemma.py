"""Gemma 2 and Gemma 3 text decoders.

Differences from Llama: embeddings scaled by sqrt(hidden), RMSNorm weights stored as an offset from 1,
norms after attention and after the MLP as well as before, a GELU-tanh gated MLP, queries scaled by
query_pre_attn_scalar, optional soft-capping of the attention scores (Gemma 2; those layers attend on the torch
path) and of the final logits, and (Gemma 3) QK-norm plus a separate RoPE
base for sliding-window layers. Attention goes through llama.py's Attention, so the per-layer window comes from
the same metadata as for every other model. Parameter names follow Hugging Face.

As in llama.py, q/k/v and gate/up are fused at load, every projection and the LM head run through ops `linear`
(panel copies for steps of many rows), the residual stream is carried between layers with each add fused with the
norm after it, and decode-sized steps run models/bridged.forward_bridged (the layer bridge with Gemma's layer math).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.attention import AttentionMetadata
from kvforge.kv.pool import KVPool
from kvforge.models.bridged import LayerNorms, bridged, forward_bridged
from kvforge.models.config import ModelConfig
from kvforge.models.int8_weights import linear
from kvforge.models.layers import GatedMLP, RMSNorm, RotaryEmbedding, unfilled_embedding
from kvforge.models.llama import Attention
from kvforge.models.quant_weights import block_data
from kvforge.ops.huge_pages import move_to_huge_pages
from kvforge.ops.layers import add_rms_norm_, gelu_tanh_mul, rms_norm


class GemmaRMSNorm(RMSNorm):
    """RMSNorm whose stored weight w scales by (1 + w); `multiplier` (1 + w) is made once by `shift()` (the model's
    init_buffers), so the kernels take it as a plain RMSNorm weight."""

    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps)
        self.register_buffer("shifted", None, persistent=False)

    @torch.no_grad()
    def shift(self) -> None:
        self.shifted = 1.0 + self.weight.detach()

    @property
    def multiplier(self) -> torch.Tensor:
        return 1.0 + self.weight if self.shifted is None else self.shifted

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.multiplier, self.eps)


class GeluGatedMLP(GatedMLP):
    """down(gelu_tanh(gate(x)) * up(x)): Llama's gated MLP with Gemma's activation."""

    activation = "gelu_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is not None:
            return linear(gelu_tanh_mul(linear(x, self.gate_up_weight)), self.down_proj.weight)
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

    def forward(self, x, residual, rope, meta, kv):
        """x: the previous layer's normed MLP output, not yet added to the residual stream (at the first layer,
        residual is None and x the scaled embeddings). Returns this layer's and the stream, added to in place."""
        cos, sin = rope["local" if self.sliding else "global"]
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h = add_rms_norm_(residual, x, self.input_layernorm.multiplier, self.input_layernorm.eps)
        attn = self.post_attention_layernorm(self.self_attn(h, cos, sin, meta, kv))
        h = add_rms_norm_(residual, attn, self.pre_feedforward_layernorm.multiplier, self.pre_feedforward_layernorm.eps)
        return self.post_feedforward_layernorm(self.mlp(h)), residual

    def bridge_norms(self) -> LayerNorms:
        attn = self.self_attn
        q, k = (attn.q_norm.multiplier, attn.k_norm.multiplier) if attn.qk_norm else (None, None)
        return LayerNorms(self.input_layernorm.multiplier, self.pre_feedforward_layernorm.multiplier,
                          self.post_attention_layernorm.multiplier, self.post_feedforward_layernorm.multiplier, q, k)


class GemmaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = unfilled_embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class GemmaForCausalLM(nn.Module):
    use_bridge = True  # decode-sized steps through the compiled layer bridge (models/bridged.py) where it serves

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
        for layer in self.model.layers:
            layer.self_attn.fuse_projections()
            layer.mlp.fuse_projections()
        move_to_huge_pages(self, block_data(self))  # a decode step streams every weight: ~1.6x the bandwidth of 4 KB pages
        for module in self.modules():
            if isinstance(module, GemmaRMSNorm):
                module.shift()

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv: KVPool) -> torch.Tensor:
        """Hidden states [T, hidden] of the flattened tokens of one step."""
        rope = {"global": self.rotary.cos_sin(meta.positions)}
        if any(layer.sliding for layer in self.model.layers):
            rope["local"] = self.rotary_local.cos_sin(meta.positions)
        x = self.model.embed_tokens(input_ids) * torch.tensor(self.embed_scale, dtype=torch.float32).to(
            self.model.embed_tokens.weight.dtype)
        weights = bridged(self, x) if self.use_bridge else None
        if weights is not None:
            per_layer = [rope["local" if layer.sliding else "global"] for layer in self.model.layers]
            return forward_bridged(self, weights, x, per_layer, meta, kv, range(len(self.model.layers)))
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, rope, meta, kv)
        norm = self.model.norm
        return norm(x) if residual is None else add_rms_norm_(residual, x, norm.multiplier, norm.eps)

    def linear_weights(self) -> list[torch.Tensor]:
        return [self.lm_head.weight]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.lm_head.weight)
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

