"""Granite 4.0-H (GraniteMoeHybridForCausalLM; Bamba's layout): Mamba-2 mixer layers and a few attention layers,
each followed by a shared gated MLP and, with experts, a top-k MoE; muP multipliers on the embeddings, the residual
branches, the attention scores and the logits.

Attention layers keep paged KV (KV layer i is model layer `attention_layers[i]`); mixer layers keep their state in
the engine's state pool (models/mamba2_mixer.py). Parameter names follow the released checkpoints.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.attention import AttentionMetadata, attend
from kvforge.kv.pool import KVPool
from kvforge.models.config import ModelConfig
from kvforge.models.int8_weights import linear
from kvforge.models.layers import RMSNorm, RotaryEmbedding
from kvforge.models.llama import Attention
from kvforge.models.mamba2_mixer import Mamba2Mixer
from kvforge.ops.layers import rope


class GraniteAttention(Attention):
    def __init__(self, cfg: ModelConfig, kv_layer: int):
        super().__init__(cfg, kv_layer)
        self.scale = cfg.extra["attention_multiplier"]
        self.use_rope = cfg.extra["rope"]
        if cfg.attention_bias:
            self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=True)

    def forward(self, x, cos, sin, meta: AttentionMetadata, kv: KVPool) -> torch.Tensor:
        q, k, v = self.project_qkv(x)
        if self.use_rope:
            q, k = rope(q, cos, sin), rope(k, cos, sin)
        kv.write(self.layer_idx, meta, k, v)
        out = attend(q, kv.layers[self.layer_idx], meta.for_layer(self.layer_idx), self.scale)
        return linear(out.reshape(x.shape[0], -1), self.o_proj.weight, self.o_proj.bias)


class SharedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.input_linear = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.output_linear = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.input_linear(x).chunk(2, dim=-1)
        return self.output_linear(F.silu(gate) * up)


class Router(nn.Module):
    def __init__(self, hidden: int, experts: int):
        super().__init__()
        self.layer = nn.Linear(hidden, experts, bias=False)


class GraniteMoE(nn.Module):
    """Top-k experts of a softmax over the k best router logits (a plain torch loop over the experts hit)."""

    def __init__(self, hidden: int, intermediate: int, experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.router = Router(hidden, experts)
        self.input_linear = nn.Module()
        self.input_linear.weight = nn.Parameter(torch.empty(experts, 2 * intermediate, hidden))
        self.output_linear = nn.Module()
        self.output_linear.weight = nn.Parameter(torch.empty(experts, hidden, intermediate))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router.layer(x).float()
        top, index = logits.topk(self.top_k, dim=-1)
        weights = torch.softmax(top, dim=-1).to(x.dtype)
        out = torch.zeros_like(x)
        for e in index.unique().tolist():
            rows, k = torch.where(index == e)
            gate, up = F.linear(x[rows], self.input_linear.weight[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.output_linear.weight[e]) * weights[rows, k, None]
            out.index_add_(0, rows, y)
        return out


class GraniteHybridLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        x = cfg.extra
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if layer in cfg.attention_layers:
            self.self_attn = GraniteAttention(cfg, cfg.attention_layers.index(layer))
        else:
            self.mamba = Mamba2Mixer(cfg.hidden_size, x["mamba"], layer)
        self.block_sparse_moe = (GraniteMoE(cfg.hidden_size, cfg.intermediate_size, x["num_local_experts"],
                                            x["num_experts_per_tok"]) if x["num_local_experts"] > 0 else None)
        self.shared_mlp = SharedMLP(cfg.hidden_size, x["shared_intermediate_size"])
        self.residual_multiplier = x["residual_multiplier"]

    def forward(self, x, cos, sin, meta, kv):
        h = self.input_layernorm(x)
        h = self.self_attn(h, cos, sin, meta, kv) if hasattr(self, "self_attn") else self.mamba(h, meta, kv)
        x = x + h * self.residual_multiplier
        h = self.post_attention_layernorm(x)
        mlp = self.shared_mlp(h)
        if self.block_sparse_moe is not None:
            mlp = self.block_sparse_moe(h) + mlp
        return x + mlp * self.residual_multiplier


class GraniteHybridModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(GraniteHybridLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class GraniteHybridForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = GraniteHybridModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)

    def init_buffers(self) -> None:
        cfg = self.config
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv: KVPool) -> torch.Tensor:
        cos, sin = self.rotary.cos_sin(meta.positions) if self.config.extra["rope"] else (None, None)
        x = self.model.embed_tokens(input_ids) * self.config.extra["embedding_multiplier"]
        for layer in self.model.layers:
            x = layer(x, cos, sin, meta, kv)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden) / self.config.extra["logits_scaling"]
