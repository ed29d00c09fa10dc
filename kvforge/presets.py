"""Published architectures by name, as their config.json files give them (for `kvforge memory`)."""
from __future__ import annotations

import copy

from kvforge.errors import ConfigError
from kvforge.models.config import ModelConfig


def _llama(vocab: int, hidden: int, inter: int, layers: int, heads: int, kv: int, ctx: int, theta: float = 1e4,
           eps: float = 1e-5, arch: str = "llama", **kw) -> ModelConfig:
    return ModelConfig(arch, vocab, hidden, inter, layers, heads, kv, hidden // heads, rope_theta=theta,
                       rms_norm_eps=eps, max_position_embeddings=ctx, **kw)


def _yarn(mscale: float) -> dict:
    return {"rope_type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
            "beta_slow": 1, "mscale": mscale, "mscale_all_dim": mscale}


_MLA = {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}

PRESETS: dict[str, ModelConfig] = {
    "llama-2-7b": _llama(32000, 4096, 11008, 32, 32, 32, 4096, bos_token_id=1, eos_token_ids=[2]),
    "llama-2-13b": _llama(32000, 5120, 13824, 40, 40, 40, 4096, bos_token_id=1, eos_token_ids=[2]),
    "llama-2-70b": _llama(32000, 8192, 28672, 80, 64, 8, 4096, bos_token_id=1, eos_token_ids=[2]),
    "llama-3-8b": _llama(128256, 4096, 14336, 32, 32, 8, 8192, 5e5, bos_token_id=128000, eos_token_ids=[128001]),
    "llama-3-70b": _llama(128256, 8192, 28672, 80, 64, 8, 8192, 5e5, bos_token_id=128000, eos_token_ids=[128001]),
    "mistral-7b": _llama(32000, 4096, 14336, 32, 32, 8, 32768, sliding_window=4096, bos_token_id=1,
                         eos_token_ids=[2]),
    "qwen2.5-7b": _llama(152064, 3584, 18944, 28, 28, 4, 32768, 1e6, 1e-6, "qwen2", attention_bias=True,
                         bos_token_id=151643, eos_token_ids=[151645]),
    "qwen2.5-72b": _llama(152064, 8192, 29568, 80, 64, 8, 32768, 1e6, 1e-6, "qwen2", attention_bias=True,
                          bos_token_id=151643, eos_token_ids=[151645]),
    "smollm2-135m": _llama(49152, 576, 1536, 30, 9, 3, 8192, 1e5, tie_word_embeddings=True, bos_token_id=1,
                           eos_token_ids=[2]),
    "deepseek-v2": ModelConfig(
        "deepseek_v2", 102400, 5120, 12288, 60, 128, 128, 192, rms_norm_eps=1e-6, max_position_embeddings=163840,
        rope_scaling=_yarn(0.707), bos_token_id=100000, eos_token_ids=[100001],
        extra={**_MLA, "n_routed_experts": 160, "n_shared_experts": 2, "num_experts_per_tok": 6,
               "moe_intermediate_size": 1536, "first_k_dense_replace": 1, "moe_layer_freq": 1,
               "routed_scaling_factor": 16.0, "topk_method": "group_limited_greedy", "n_group": 8, "topk_group": 3,
               "norm_topk_prob": False, "scoring_func": "softmax"},
    ),
    "deepseek-v3": ModelConfig(
        "deepseek_v3", 129280, 7168, 18432, 61, 128, 128, 192, rms_norm_eps=1e-6, max_position_embeddings=163840,
        rope_scaling=_yarn(1.0), bos_token_id=0, eos_token_ids=[1],
        extra={**_MLA, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
               "moe_intermediate_size": 2048, "first_k_dense_replace": 3, "moe_layer_freq": 1,
               "routed_scaling_factor": 2.5, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
               "norm_topk_prob": True, "scoring_func": "sigmoid", "num_nextn_predict_layers": 1},
    ),
}


# the dtype each model's weights are published in (their config.json's torch_dtype): the default weight estimate
PUBLISHED_DTYPE: dict[str, str] = {
    "llama-2-7b": "fp16", "llama-2-13b": "fp16", "llama-2-70b": "fp16", "llama-3-8b": "bf16", "llama-3-70b": "bf16",
    "mistral-7b": "bf16", "qwen2.5-7b": "bf16", "qwen2.5-72b": "bf16", "smollm2-135m": "bf16", "deepseek-v2": "bf16",
    "deepseek-v3": "fp8",
}


def get_preset(name: str) -> ModelConfig:
    try:
        return copy.deepcopy(PRESETS[name.lower()])
    except KeyError:
        raise ConfigError(f"unknown model preset {name!r}; presets: {', '.join(PRESETS)}") from None
