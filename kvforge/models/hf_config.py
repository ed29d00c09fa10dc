"""ModelConfig from a Hugging Face config.json (Llama, Mistral, Qwen2, Qwen3, Gemma 2/3, DeepSeek-V2/V3; Mamba-2 and
Granite 4.0-H hybrids through models/recurrent_config.py)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvforge.errors import ModelLoadError
from kvforge.models.config import ModelConfig
from kvforge.models.gemma_config import GEMMA_ARCHES, gemma_from_hf
from kvforge.models.recurrent_config import recurrent_arch, recurrent_from_hf

ARCH_BY_MODEL_TYPE = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "deepseek_v2": "deepseek_v2",
    "deepseek_v3": "deepseek_v3",
}
ARCH_BY_CLASS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
MOE_KEYS = (
    "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size",
    "first_k_dense_replace", "moe_layer_freq", "routed_scaling_factor", "topk_method", "n_group",
    "topk_group", "norm_topk_prob", "scoring_func", "num_nextn_predict_layers", "rope_interleave",
)


def is_supported(cfg: dict[str, Any]) -> bool:
    """Whether kvforge runs this architecture (else only `kvforge memory` reads it, by its standard fields)."""
    return (cfg.get("model_type") in ARCH_BY_MODEL_TYPE or any(c in ARCH_BY_CLASS for c in cfg.get("architectures") or [])
            or recurrent_arch(cfg) is not None)


def detect_arch(cfg: dict[str, Any]) -> str:
    arch = ARCH_BY_MODEL_TYPE.get(cfg.get("model_type") or "")
    for cls in cfg.get("architectures") or []:
        arch = arch or ARCH_BY_CLASS.get(cls)
    if arch is None:
        supported = ", ".join(sorted(ARCH_BY_MODEL_TYPE))
        classes = ", ".join(ARCH_BY_CLASS)
        raise ModelLoadError(
            f"unsupported model_type {cfg.get('model_type')!r} (architectures {cfg.get('architectures')}); "
            f"supported model_type: {supported} ({classes})"
        )
    return arch


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta") or params.get("rope_theta") or 10000.0
    scaling = cfg.get("rope_scaling") or {k: v for k, v in params.items() if k != "rope_theta"}
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind in (None, "default"):
        return float(theta), None
    return float(theta), {**scaling, "rope_type": kind}


def _eos_ids(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _require(cfg: dict[str, Any], *keys: str) -> None:
    missing = [k for k in keys if cfg.get(k) is None]
    if missing:
        raise ModelLoadError(f"config.json lacks required keys {missing}")


LAYER_TYPES = ("full_attention", "sliding_attention")


def _sliding(cfg: dict[str, Any], arch: str) -> tuple[int | None, list[str] | None]:
    """(sliding_window, per-layer types) as transformers reads them: Qwen2/3 window only with
    `use_sliding_window` (default off) and, without `layer_types`, on layers from `max_window_layers` on;
    Mistral (model_type mistral) windows every layer and ignores `layer_types`."""
    qwen = arch.startswith("qwen")
    sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window", not qwen) else None
    if not sliding or cfg.get("model_type") == "mistral":
        return sliding, None
    types = cfg.get("layer_types")
    n = int(cfg["num_hidden_layers"])
    if types is None and qwen:
        first = int(cfg.get("max_window_layers", 28) if cfg.get("max_window_layers") is not None else 28)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    if types is None:
        return sliding, None
    if len(types) != n or any(t not in LAYER_TYPES for t in types):
        raise ModelLoadError(f"config.json layer_types must list one of {LAYER_TYPES} per layer ({n} layers), "
                             f"got {types!r}")
    return sliding, list(types)


def model_config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """Translate a Hugging Face config dict into a ModelConfig."""
    if recurrent_arch(cfg) is not None:
        return recurrent_from_hf(cfg)
    arch = detect_arch(cfg)
    _require(cfg, "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    extra: dict[str, Any] = {}
    sliding, layer_types = _sliding(cfg, arch)
    if arch.startswith("deepseek"):
        _require(cfg, "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        extra = {k: cfg.get(k) for k in MLA_KEYS + MOE_KEYS if k in cfg}
        kv_heads = heads
        head_dim = int(cfg["qk_nope_head_dim"]) + int(cfg["qk_rope_head_dim"])
    theta, scaling = _rope(cfg) if arch not in GEMMA_ARCHES else (10000.0, None)
    fields = {
        "rope_theta": theta,
        "rope_scaling": scaling,
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "qk_norm": arch == "qwen3",
        "sliding_window": int(sliding) if sliding else None,
        "layer_types": layer_types,
        "extra": extra,
    }
    if arch in GEMMA_ARCHES:
        fields.update(gemma_from_hf(cfg, arch))
    return ModelConfig(
        arch=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps") or 1e-6),
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 4096),
        attention_bias=True if arch == "qwen2" else bool(cfg.get("attention_bias", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_ids(cfg.get("eos_token_id")),
        **fields,
    )


def load_hf_config(path: str | Path) -> ModelConfig:
    """ModelConfig from a config.json file or a directory holding one."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"no config.json at {path}") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {path} as JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{path} is not a JSON object")
    return model_config_from_hf(cfg)
