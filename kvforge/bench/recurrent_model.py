"""A random model shaped like IBM Granite 4.0-H (GraniteMoeHybridForCausalLM), ~110M parameters, for the prefix and
memory benchmarks of recurrent hybrids when no real checkpoint is installed: 12 layers, Mamba-2 mixers (24 heads of
64, d_state 128, one group) with an attention layer (12 query / 4 KV heads, no RoPE) at layers 5 and 11, a dense
shared MLP, Granite's vocabulary size and muP multipliers. Its weights are random: figures from it measure the
engine (cache hits, time, bytes), never quality. config.json says so (`kvforge_random_weights`), and so do the
benchmarks' outputs.

    python -m kvforge.bench.recurrent_model DIR     then     kvforge bench prefix --model DIR
    python -m kvforge.bench.recurrent_model DIR --small    then    kvforge bench memory --model DIR --vs-attention
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

LAYER_TYPES = ["full_attention" if i in (5, 11) else "mamba" for i in range(12)]
CONFIG = {
    "model_type": "granitemoehybrid", "architectures": ["GraniteMoeHybridForCausalLM"], "vocab_size": 49160,
    "hidden_size": 768, "intermediate_size": 512, "num_hidden_layers": 12, "num_attention_heads": 12,
    "num_key_value_heads": 4, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "layer_types": LAYER_TYPES,
    "num_local_experts": 0, "num_experts_per_tok": 0, "shared_intermediate_size": 2048,
    "position_embedding_type": "nope", "tie_word_embeddings": True, "embedding_multiplier": 12.0,
    "logits_scaling": 3.0, "residual_multiplier": 0.22, "attention_multiplier": 0.0078125,
    "mamba_n_heads": 24, "mamba_d_head": 64, "mamba_d_state": 128, "mamba_n_groups": 1, "mamba_d_conv": 4,
    "mamba_expand": 2, "mamba_conv_bias": True, "mamba_proj_bias": False, "bos_token_id": 0, "eos_token_id": 0,
    "kvforge_random_weights": True,
}

# the same 12-layer pattern at width 128 (~2M parameters with its 8k vocabulary) and an 8,192-token context, for
# runs of many long sequences on a CPU (bench memory --vs-attention): `--small`
SMALL_CONFIG = dict(CONFIG, vocab_size=8192, hidden_size=128, intermediate_size=128, shared_intermediate_size=256,
                    num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=4, mamba_d_head=64, mamba_d_state=32,
                    max_position_embeddings=8192)


def is_random(directory: str | Path | None) -> bool:
    """Whether a model directory holds random weights written by this module (benchmarks say so)."""
    path = Path(directory) / "config.json" if directory else None
    try:
        return bool(path and json.loads(path.read_text()).get("kvforge_random_weights"))
    except (OSError, ValueError):
        return False


def write_recurrent_model(directory: str | Path, seed: int = 0, config: dict | None = None) -> Path:
    """config.json (`config`, by default CONFIG) and random weights in `directory` (std 0.02; Mamba-2's A and dt as
    its initialisation)."""
    from safetensors.torch import save_file

    from kvforge.models.hf_config import model_config_from_hf
    from kvforge.models.loader import model_class

    config = dict(CONFIG if config is None else config, kvforge_random_weights=True)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = model_class(cfg := model_config_from_hf(config))(cfg)
    heads = config["mamba_n_heads"]
    weights = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        if name.endswith("A_log"):
            w = torch.log(torch.arange(1, heads + 1, dtype=torch.float32))
        elif name.endswith("dt_bias"):  # softplus(dt_bias) log-uniform in [1e-3, 1e-1]
            dt = torch.exp(torch.rand(heads) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
            w = dt + torch.log(-torch.expm1(-dt))
        elif name.endswith((".D", "norm.weight")):
            w = torch.ones(t.shape)
        else:
            w = torch.randn(t.shape) * 0.02
        weights[name] = w.contiguous()
    save_file(weights, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return directory


if __name__ == "__main__":
    paths = [a for a in sys.argv[1:] if a != "--small"]
    print(write_recurrent_model(paths[0] if paths else "granite-h-random",
                                config=SMALL_CONFIG if "--small" in sys.argv else None))
