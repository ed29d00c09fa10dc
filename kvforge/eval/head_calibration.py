"""Find a model's retrieval heads: the attention each KV head puts on the token it copies from a generated context.

As the retrieval-head papers do (Wu et al., "Retrieval Head Mechanistically Explains Long-Context Factuality", 2024,
arXiv:2404.15574; DuoAttention, Xiao et al., 2024, arXiv:2410.10819, splits heads the same way): a needle of random
tokens is hidden in filler, and after the filler the needle is given again and teacher-forced. At each step of that
copy the next needle token sits at a known place in the context; a head's score is the attention its query heads
(max over those sharing the KV head) put there, averaged over every copy step of `trials` generated contexts. No
download, no labels; deterministic for a seed. Llama-family attention layers (project_qkv, RoPE), as evict_sim.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvforge.errors import ConfigError
from kvforge.kv.policies.head_roles import HeadScores, model_identity
from kvforge.rope import apply_rope

METHOD = "copy-attention"


@dataclass(frozen=True)
class CalibrationConfig:
    """context: tokens of filler before the copy; needle: tokens copied; trials: contexts averaged; seed."""

    context: int = 1024
    needle: int = 24
    trials: int = 4
    seed: int = 0

    def __post_init__(self):
        if self.needle < 4 or self.context < 2 * self.needle or self.trials < 1:
            raise ConfigError(f"calibrate heads: needs needle >= 4, context >= 2 x needle and trials >= 1, got "
                              f"needle {self.needle}, context {self.context}, trials {self.trials}")


def copy_case(vocab: int, cfg: CalibrationConfig, trial: int) -> tuple[list[int], int]:
    """One context's token ids (filler with the needle at a random place, then the needle again) and where the
    needle starts in the filler. Token ids from vocab // 8 up, so special tokens at the start of a vocabulary
    are avoided."""
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + trial)
    low = min(vocab // 8, vocab - 2)
    filler = torch.randint(low, vocab, (cfg.context,), generator=g)
    needle = torch.randint(low, vocab, (cfg.needle,), generator=g)
    at = int(torch.randint(cfg.needle, cfg.context - 2 * cfg.needle, (1,), generator=g)) if cfg.context > 3 * cfg.needle \
        else cfg.needle // 2
    filler[at: at + cfg.needle] = needle
    return torch.cat([filler, needle]).tolist(), at


@torch.inference_mode()
def copy_attention(model, ids: list[int], at: int, needle: int) -> torch.Tensor:
    """[layers, kv heads]: the mean attention, over the copy's steps 1..needle-1, that the query at the needle's
    second occurrence puts on the source of the token it must produce next (max over the KV head's query heads)."""
    mc, layers = model.config, model.model.layers
    kv_heads, group = mc.num_kv_heads, mc.num_heads // mc.num_kv_heads
    if not all(hasattr(layer.self_attn, "project_qkv") for layer in layers):
        raise ConfigError("calibrate heads: this model's layers are not Llama-family attention (project_qkv); "
                          "supported: Llama, Mistral, Qwen2/3 shaped models")
    n = len(ids)
    start = n - needle  # where the second occurrence begins
    queries = torch.arange(start, n - 1)  # query start + i - 1 predicts needle token i, found at at + i
    sources = torch.arange(at + 1, at + needle)
    cos, sin = model.rotary.cos_sin(torch.arange(n))
    x = model.model.embed_tokens(torch.tensor(ids))
    out = torch.zeros(len(layers), kv_heads)
    for li, layer in enumerate(layers):
        att = layer.self_attn
        q, k, v = att.project_qkv(layer.input_layernorm(x))
        if att.qk_norm:
            q, k = att.q_norm(q), att.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        full = torch.einsum("qhd,khd->hqk", q, kk) * att.scale
        full = full.masked_fill(~(torch.arange(n)[None, :] <= torch.arange(n)[:, None]), float("-inf"))
        probs = torch.softmax(full, -1)
        picked = probs[:, queries, sources]  # [query heads, copy steps]
        out[li] = picked.unflatten(0, (kv_heads, group)).amax(1).mean(-1)
        x = x + att.o_proj(torch.einsum("hqk,khd->qhd", probs, vv).reshape(n, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return out


def calibrate_heads(loaded, cfg: CalibrationConfig = CalibrationConfig()) -> HeadScores:
    """Every KV head's retrieval score on the loaded model, averaged over cfg.trials generated contexts."""
    vocab = loaded.config.vocab_size
    total = None
    for trial in range(cfg.trials):
        ids, at = copy_case(vocab, cfg, trial)
        s = copy_attention(loaded.model, ids, at, cfg.needle)
        total = s if total is None else total + s
    detail = {"context": cfg.context, "needle": cfg.needle, "trials": cfg.trials, "seed": cfg.seed}
    return HeadScores(total / cfg.trials, METHOD, model_identity(loaded.path), detail)
