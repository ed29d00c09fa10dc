"""Mamba-2 (Mamba2ForCausalLM): a stack of pre-normed Mamba-2 mixers, no attention, so no KV rows at all: each
sequence holds only its state slot (models/mamba2_mixer.py). Parameter names follow Hugging Face (`backbone.*`)."""
from __future__ import annotations

import torch
from torch import nn

from kvforge.attention import AttentionMetadata
from kvforge.kv.pool import KVPool
from kvforge.models.config import ModelConfig
from kvforge.models.layers import RMSNorm
from kvforge.models.mamba2_mixer import Mamba2Mixer


class Mamba2Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mixer = Mamba2Mixer(cfg.hidden_size, cfg.extra["mamba"], layer)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, kv: KVPool) -> torch.Tensor:
        return x + self.mixer(self.norm(x), meta, kv)


class Mamba2Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Mamba2Block(cfg, i) for i in range(cfg.num_layers))
        self.norm_f = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Mamba2ForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.backbone = Mamba2Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.backbone.embeddings.weight

    def init_buffers(self) -> None:
        """Nothing to recreate (no rotary tables)."""

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv: KVPool) -> torch.Tensor:
        x = self.backbone.embeddings(input_ids)
        for layer in self.backbone.layers:
            x = layer(x, meta, kv)
        return self.backbone.norm_f(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
