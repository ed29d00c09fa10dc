"""Tiny random Hugging Face models written to a directory, for fast exact-logit tests."""
from __future__ import annotations

import torch

TINY = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "max_position_embeddings": 512, "rope_theta": 10000.0}


def hf_config(kind: str):
    import transformers as tf

    if kind == "llama-mha":
        return tf.LlamaConfig(**TINY, num_key_value_heads=4)
    if kind == "llama-gqa":
        return tf.LlamaConfig(**TINY, num_key_value_heads=2)
    if kind == "llama-mqa":
        return tf.LlamaConfig(**TINY, num_key_value_heads=1, tie_word_embeddings=True)
    if kind == "mistral":
        return tf.MistralConfig(**TINY, num_key_value_heads=2, sliding_window=24)
    if kind == "qwen2":
        return tf.Qwen2Config(**TINY, num_key_value_heads=2)
    if kind == "qwen2-hybrid":  # alternating full / sliding layers, window shorter than the test sequences
        return tf.Qwen2Config(**{**TINY, "num_hidden_layers": 4}, num_key_value_heads=2, use_sliding_window=True,
                              sliding_window=12, layer_types=["full_attention", "sliding_attention"] * 2)
    if kind == "qwen2-window-layers":  # no layer_types: layers from max_window_layers on slide
        return tf.Qwen2Config(**{**TINY, "num_hidden_layers": 3}, num_key_value_heads=2, use_sliding_window=True,
                              sliding_window=10, max_window_layers=1)
    if kind == "qwen3":
        return tf.Qwen3Config(**TINY, num_key_value_heads=2, head_dim=32)
    if kind.startswith("deepseek"):
        return _deepseek_config(kind)
    if kind.startswith("gemma"):
        return _gemma_config(kind)
    if kind in RECURRENT:
        return _recurrent_config(kind)
    raise ValueError(kind)


RECURRENT = ("granite-hybrid", "granite-hybrid-nope", "mamba2", "mamba2-one-group", "lfm2", "rwkv", "qwen3-next")
MAMBA_SMALL = {"mamba_n_heads": 8, "mamba_n_groups": 2, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_chunk_size": 16}


def _recurrent_config(kind: str):
    """Granite 4.0-H shaped: Mamba-2 mixers around one attention layer, MoE + shared MLP, muP multipliers (RoPE, or
    none as the released models); pure Mamba-2. Chunk sizes of 16 so transformers' own scan crosses chunks."""
    import transformers as tf

    if kind == "lfm2":  # conv, attention, conv, conv; conv biases on; MLP width as LFM2 derives it (auto-adjusted)
        return tf.Lfm2Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                             layer_types=["conv", "full_attention", "conv", "conv"], conv_bias=True,
                             block_multiple_of=16, initializer_range=0.2, tie_word_embeddings=True)
    if kind == "qwen3-next":  # 4 value heads over 2 key heads, partial RoPE, MoE on layers 2 and 4, dense MLP on 1 and 3
        return tf.Qwen3NextConfig(
            vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, linear_num_value_heads=4,
            linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            decoder_sparse_step=2, partial_rotary_factor=0.25, initializer_range=0.2,
            layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"])
    if kind == "rwkv":  # rescale_every 2: the inference rescaling of 4 layers applies twice
        return tf.RwkvConfig(vocab_size=96, hidden_size=64, num_hidden_layers=4, attention_hidden_size=64,
                             intermediate_size=128, context_length=512, rescale_every=2)
    if kind.startswith("mamba2"):  # one group (as Granite 4.0-H): B and C shared by every head, one norm group
        return tf.Mamba2Config(vocab_size=96, hidden_size=64, num_hidden_layers=3, num_heads=8, head_dim=16,
                               state_size=16, n_groups=1 if kind.endswith("one-group") else 2, expand=2,
                               conv_kernel=4, chunk_size=16, initializer_range=0.2)
    return tf.GraniteMoeHybridConfig(
        vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, **MAMBA_SMALL,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=48,
        position_embedding_type="rope" if kind == "granite-hybrid" else None, embedding_multiplier=2.0,
        logits_scaling=1.5, residual_multiplier=0.7, attention_multiplier=0.2)


def _gemma_config(kind: str):
    """Gemma 2: attention and final logit soft-caps (the attention cap low enough to bind), alternating layers. Gemma 3: QK-norm, linear-scaled global RoPE, a local base.
    Windows are shorter than the tests' sequences; query_pre_attn_scalar differs from head_dim."""
    import transformers as tf

    common = {**TINY, "num_key_value_heads": 2, "head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 12,
              "initializer_range": 0.2}
    if kind == "gemma2":
        return tf.Gemma2Config(**common, attn_logit_softcapping=2.0, final_logit_softcapping=3.0)
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}
    return tf.Gemma3TextConfig(**{**common, "rope_theta": None, "num_hidden_layers": 3}, rope_parameters=rope,
                               layer_types=["sliding_attention", "full_attention", "sliding_attention"])


MLA = {"kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 12, "num_key_value_heads": 4,
       "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
       "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1, "initializer_range": 0.1}


def _deepseek_config(kind: str):
    """V2: plain q_proj, group-limited greedy softmax routing. V3: q LoRA, noaux_tc sigmoid routing."""
    import transformers as tf

    if kind == "deepseek-v2":
        return tf.DeepseekV2Config(**TINY, **MLA, q_lora_rank=None, topk_method="group_limited_greedy",
                                   routed_scaling_factor=1.5)
    if kind == "deepseek-v3":
        return tf.DeepseekV3Config(**TINY, **MLA, q_lora_rank=32, routed_scaling_factor=2.5)
    if kind == "deepseek-v3-yarn":
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
                "mscale": 0.7, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}
        return tf.DeepseekV3Config(**{**TINY, "rope_theta": None}, **MLA, q_lora_rank=32, rope_interleave=False,
                                   rope_parameters=rope, norm_topk_prob=False)
    raise ValueError(kind)


def _spread_router(model) -> None:
    """Give the MoE routers decisive scores (and V3 a non-zero correction bias), so routing is no coin toss."""
    for name, module in model.named_modules():
        if name.endswith("mlp.gate"):
            torch.nn.init.normal_(module.weight, std=1.0)
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.copy_(torch.randn_like(module.e_score_correction_bias) * 0.1)


def write_tiny_model(kind: str, directory, seed: int = 0):
    """Save a random model of `kind` (safetensors) and return the transformers model."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(kind), torch_dtype=torch.float32).eval()
    if kind.startswith("deepseek"):
        with torch.no_grad():
            _spread_router(model)
    if kind.startswith("gemma"):  # norms start at zero (scale 1 + w); random ones test that form
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(std=0.5)
    model.save_pretrained(directory, safe_serialization=True)
    return model


def tiny_maker(tmp_path_factory):
    """kind -> (directory, transformers model), each tiny model written once per fixture scope."""
    made = {}

    def get(kind):
        if kind not in made:
            d = tmp_path_factory.mktemp(kind)
            made[kind] = (d, write_tiny_model(kind, d))
        return made[kind]

    return get
