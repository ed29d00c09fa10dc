"""Tiny random Hugging Face models written to a directory, for fast exact-logit tests."""
from __future__ import annotations

import torch

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=512, rope_theta=10000.0)


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
    if kind == "qwen3":
        return tf.Qwen3Config(**TINY, num_key_value_heads=2, head_dim=32)
    raise ValueError(kind)


def write_tiny_model(kind: str, directory, seed: int = 0):
    """Save a random model of `kind` (safetensors) and return the transformers model."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(kind), torch_dtype=torch.float32).eval()
    model.save_pretrained(directory, safe_serialization=True)
    return model
