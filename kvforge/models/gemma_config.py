"""Gemma 2 / Gemma 3 architecture facts from a Hugging Face config.json or a GGUF file's metadata.

Each function returns ModelConfig keyword arguments that differ from the Llama defaults: per-layer attention
kinds, the two RoPE bases, query scaling, soft-capping and the GGUF tensor names of the extra norms.
"""
from __future__ import annotations

from typing import Any

from kvforge.models.config import FULL, SLIDING

GEMMA_ARCHES = ("gemma2", "gemma3")
_PATTERN = {"gemma2": 2, "gemma3": 6}  # every n-th layer has full attention
_LOCAL_ROPE_THETA = 10000.0
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
}
LAYER_NORMS = tuple(f"{n}.weight" for n in GGUF_LAYER_NAMES.values())


def gemma_layer_types(arch: str, num_layers: int, pattern: int | None = None) -> list[str]:
    """Gemma's interleave: every `pattern`-th layer (1-based) has full attention, the others a sliding window."""
    pattern = pattern or _PATTERN[arch]
    return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers)]


def _rope_entry(params: dict[str, Any]) -> tuple[float | None, dict[str, Any] | None]:
    theta = params.get("rope_theta")
    kind = params.get("rope_type") or params.get("type") or "default"
    scaling = None if kind == "default" else {**{k: v for k, v in params.items() if k != "rope_theta"}, "rope_type": kind}
    return (float(theta) if theta is not None else None), scaling


def gemma_from_hf(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """ModelConfig fields of a Gemma config.json (old `rope_theta`/`rope_local_base_freq` or per-kind `rope_parameters`)."""
    layers = int(cfg["num_hidden_layers"])
    params = cfg.get("rope_parameters") or {}
    if FULL in params or SLIDING in params:
        theta, scaling = _rope_entry(params.get(FULL, {}))
        local_theta, local_scaling = _rope_entry(params.get(SLIDING, {}))
    else:
        theta, scaling = _rope_entry({**params, **(cfg.get("rope_scaling") or {}),
                                      "rope_theta": cfg.get("rope_theta") or params.get("rope_theta")})
        local_theta, local_scaling = cfg.get("rope_local_base_freq"), None
    theta = theta or (1e6 if arch == "gemma3" else 10000.0)
    if arch == "gemma2":
        local_theta, local_scaling = theta, scaling
    window = cfg.get("sliding_window")
    pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern")
    types = list(cfg.get("layer_types") or gemma_layer_types(arch, layers, pattern)) if window else None
    extra = {
        "rope_local_theta": float(local_theta or _LOCAL_ROPE_THETA),
        "rope_local_scaling": local_scaling,
        "query_pre_attn_scalar": cfg.get("query_pre_attn_scalar") or cfg.get("head_dim"),
        "attn_logit_softcapping": cfg.get("attn_logit_softcapping"),
        "final_logit_softcapping": cfg.get("final_logit_softcapping"),
    }
    return {
        "rope_theta": float(theta), "rope_scaling": scaling, "qk_norm": arch == "gemma3",
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
        "sliding_window": int(window) if window else None, "layer_types": types, "extra": extra,
    }


def gemma_from_gguf(meta: dict[str, Any], arch: str, num_layers: int, head_dim: int) -> dict[str, Any]:
    """ModelConfig fields of a Gemma GGUF; what llama.cpp does not store takes Gemma's published defaults."""
    window = meta.get(f"{arch}.attention.sliding_window")
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):  # one flag per layer: True = sliding window
        types = [SLIDING if p else FULL for p in pattern]
    else:
        types = gemma_layer_types(arch, num_layers, pattern)
    return {
        "qk_norm": arch == "gemma3",
        "sliding_window": int(window) if window else None,
        "layer_types": types if window else None,
        "extra": {
            "rope_local_theta": _LOCAL_ROPE_THETA if arch == "gemma3" else float(meta.get(f"{arch}.rope.freq_base",
                                                                                          _LOCAL_ROPE_THETA)),
            "query_pre_attn_scalar": head_dim,
            "attn_logit_softcapping": meta.get(f"{arch}.attn_logit_softcapping"),
            "final_logit_softcapping": meta.get(f"{arch}.final_logit_softcapping"),
        },
    }
