"""A random model with Gemma 3 270M's KV shape, for the hybrid-attention memory benchmark before real weights.

Qwen2 form (any model with `layer_types` runs the same KV groups): 18 layers, one full-attention layer in
every six, a 512-token window elsewhere, 1 KV head, 4 query heads. Narrow hidden size and head_dim 64 keep
CPU runs short; the memory ratios depend only on layers, window and block size.

    python -m kvforge.bench.hybrid_model DIR     then     kvforge bench memory --model DIR --json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

LAYER_TYPES = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)]
CONFIG = {
    "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 512, "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 64, "max_position_embeddings": 8192, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
    "use_sliding_window": True, "sliding_window": 512, "layer_types": LAYER_TYPES, "tie_word_embeddings": True,
}


def write_hybrid_model(directory: str | Path, seed: int = 0) -> Path:
    """config.json and random weights (std 0.02) in `directory`."""
    from safetensors.torch import save_file

    from kvforge.models.hf_config import model_config_from_hf
    from kvforge.models.loader import model_class

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = model_class(cfg := model_config_from_hf(CONFIG))(cfg)
    weights = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        weights[name] = torch.ones_like(t) if name.endswith("norm.weight") else torch.randn_like(t) * 0.02
    save_file(weights, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(CONFIG, indent=1))
    return directory


if __name__ == "__main__":
    print(write_hybrid_model(sys.argv[1] if len(sys.argv) > 1 else "hybrid-model"))
