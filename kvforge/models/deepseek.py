"""DeepSeek-V2 / DeepSeek-V3 decoder: MLA attention, dense MLP in the first layers, MoE after.

Parameter names follow Hugging Face (per-expert `mlp.experts.{i}.*` as in the released
checkpoints and in transformers' save_pretrained), so weights load with load_state_dict.
"""
from __future__ import annotations

import torch
from torch import nn

from kvforge.attention import AttentionMetadata
from kvforge.kv.pool import KVPool
from kvforge.models.config import ModelConfig
from kvforge.models.int8_weights import linear
from kvforge.models.layers import GatedMLP, RMSNorm, unfilled_embedding
from kvforge.models.mla_attention import MLAAttention, MLARotary
from kvforge.models.moe import DeepseekMoE, is_moe_layer


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = MLAAttention(cfg, layer_idx)
        moe = is_moe_layer(cfg, layer_idx)
        self.mlp = DeepseekMoE(cfg) if moe else GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary: MLARotary,
                meta: AttentionMetadata, kv: KVPool) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, rotary, meta, kv)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = unfilled_embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def _rotary(cfg: ModelConfig) -> MLARotary:
    interleave = bool(cfg.extra.get("rope_interleave", True)) if cfg.arch == "deepseek_v3" else True
    return MLARotary(int(cfg.extra["qk_rope_head_dim"]), cfg.rope_theta, cfg.rope_scaling,
                     cfg.max_position_embeddings, interleave)


class DeepseekForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.rotary = _rotary(cfg)
        self.model = DeepseekModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_buffers(self) -> None:
        """Recreate non-persistent buffers after loading weights onto a meta-built model; gate and up of every
        MLP (dense, routed and shared experts) fused into one weight (views, as in llama.py)."""
        self.rotary = _rotary(self.config)
        for module in self.modules():
            if isinstance(module, GatedMLP):
                module.fuse_projections()

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv: KVPool) -> torch.Tensor:
        """Hidden states [T, hidden] of the flattened tokens of one step."""
        cos, sin = self.rotary.cos_sin(meta.positions)
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin, self.rotary, meta, kv)
        return self.model.norm(x)

    def linear_weights(self) -> list[torch.Tensor]:
        return [self.lm_head.weight]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.lm_head.weight)
