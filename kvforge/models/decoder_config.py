"""ModelConfig for memory arithmetic from any decoder config.json (gemma2/3, phi3, mixtral, gpt-oss, falcon, ...).

`kvforge memory` needs the KV shape only: layers, KV heads, head size, which layers keep a sliding window,
or MLA's latent size. Those come from the standard fields (and their older aliases); a config lacking one
is refused with the field's name. Other facts (vocabulary, MLP width) only feed the weight estimate.
"""
from __future__ import annotations

from typing import Any

from kvforge.errors import ModelLoadError
from kvforge.models.config import FULL, SLIDING, ModelConfig
from kvforge.models.gemma_config import gemma_layer_types

_ALIASES = {
    "num_hidden_layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
    "num_attention_heads": ("num_attention_heads", "n_head", "num_heads", "n_heads"),
    "hidden_size": ("hidden_size", "n_embd", "d_model", "dim"),
    "num_key_value_heads": ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num"),
    "intermediate_size": ("intermediate_size", "ffn_hidden_size", "n_inner", "ffn_dim"),
    "max_position_embeddings": ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"),
}


def _get(cfg: dict[str, Any], name: str) -> Any:
    for key in _ALIASES.get(name, (name,)):
        if cfg.get(key) is not None:
            return cfg[key]
    return None


def _need(cfg: dict[str, Any], name: str) -> int:
    value = _get(cfg, name)
    if value is None:
        keys = " or ".join(_ALIASES.get(name, (name,)))
        raise ModelLoadError(f"config.json lacks {name} (looked for {keys}); the KV formula needs it")
    return int(value)


def _kv_heads(cfg: dict[str, Any], heads: int) -> int:
    value = _get(cfg, "num_key_value_heads")
    if value is not None:
        return int(value)
    if cfg.get("multi_query") and not cfg.get("new_decoder_architecture"):  # Falcon-7B style: one KV head
        return 1
    return heads


def layer_types(cfg: dict[str, Any], layers: int, window: int | None) -> list[str] | None:
    """Which layers keep only a sliding window: `layer_types`, else Gemma's interleave (`sliding_window_pattern`);
    None when every layer is alike. (Architectures kvforge runs, Qwen2's `max_window_layers` included, are read
    by hf_config.)"""
    if not window:
        return None
    listed = cfg.get("layer_types")
    if listed is not None:
        if len(listed) != layers:
            raise ModelLoadError(f"config.json layer_types has {len(listed)} entries for {layers} layers")
        return [SLIDING if "sliding" in str(t) or "local" in str(t) else FULL for t in listed]
    kind = str(cfg.get("model_type"))
    family = "gemma3" if kind.startswith("gemma3") else "gemma2" if kind == "gemma2" else None
    pattern = cfg.get("sliding_window_pattern")
    if pattern or family:
        return gemma_layer_types(family or "gemma3", layers, pattern)
    return None


def decoder_config(raw: dict[str, Any]) -> ModelConfig:
    """The KV-relevant facts of a decoder config.json whatever its model_type (multimodal: its text_config)."""
    cfg = {**raw, **raw["text_config"]} if isinstance(raw.get("text_config"), dict) else raw
    layers, heads = _need(cfg, "num_hidden_layers"), _need(cfg, "num_attention_heads")
    extra: dict[str, Any] = {}
    if cfg.get("kv_lora_rank"):
        for key in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
            _need(cfg, key)
        extra = {k: cfg.get(k) for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                         "v_head_dim")}
        kv_heads, head_dim = heads, int(cfg["qk_nope_head_dim"]) + int(cfg["qk_rope_head_dim"])
    else:
        kv_heads = _kv_heads(cfg, heads)
        head_dim = cfg.get("head_dim") or _need(cfg, "hidden_size") // heads
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts")
    if experts:
        extra.update(n_routed_experts=int(experts),
                     moe_intermediate_size=int(cfg.get("moe_intermediate_size") or _get(cfg, "intermediate_size") or 0))
    uses_window = cfg.get("use_sliding_window", True)
    window = cfg.get("sliding_window") if uses_window else None
    window = int(window) if window else None
    types = layer_types(cfg, layers, window)
    hidden = int(_get(cfg, "hidden_size") or heads * int(head_dim))
    return ModelConfig(
        arch=str(cfg.get("model_type") or "unknown"), vocab_size=int(cfg.get("vocab_size") or 0), hidden_size=hidden,
        intermediate_size=0 if experts else int(_get(cfg, "intermediate_size") or 4 * hidden), num_layers=layers,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=int(head_dim),
        max_position_embeddings=int(_get(cfg, "max_position_embeddings") or 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        sliding_window=window if types is None or SLIDING in types else None, layer_types=types, extra=extra)
