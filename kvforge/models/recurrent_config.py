"""ModelConfig for recurrent and hybrid models from a Hugging Face config.json: Mamba2ForCausalLM,
GraniteMoeHybridForCausalLM (Granite 4.0-H, Bamba's layout: Mamba-2 mixers + attention layers) and Lfm2ForCausalLM
(short convolutions + attention layers).

Each recurrent layer's state is a StateGroup (kv/groups.py): a Mamba-2 mixer keeps the last d_conv - 1 inputs of
its causal convolution [d_conv - 1, conv_dim] and its SSM state [heads, head_dim, d_state]; a short conv the last
L - 1 inputs of its convolution [L - 1, hidden]; fp32.
"""
from __future__ import annotations

from typing import Any

from kvforge.errors import ModelLoadError
from kvforge.kv.groups import StateGroup
from kvforge.models.config import ModelConfig

RECURRENT_MODEL_TYPES = {"mamba2": "mamba2", "granitemoehybrid": "granitemoehybrid", "lfm2": "lfm2", "rwkv": "rwkv",
                         "qwen3_next": "qwen3_next"}
RECURRENT_CLASSES = {"Mamba2ForCausalLM": "mamba2", "GraniteMoeHybridForCausalLM": "granitemoehybrid",
                     "Lfm2ForCausalLM": "lfm2", "RwkvForCausalLM": "rwkv", "Qwen3NextForCausalLM": "qwen3_next"}
MAMBA_KINDS = ("mamba", "linear_attention")  # a layer type naming a Mamba-2 mixer (older and newer configs)
ATTENTION_KINDS = ("attention", "full_attention")


def recurrent_arch(cfg: dict[str, Any]) -> str | None:
    arch = RECURRENT_MODEL_TYPES.get(cfg.get("model_type") or "")
    for cls in cfg.get("architectures") or []:
        arch = arch or RECURRENT_CLASSES.get(cls)
    return arch


def mamba_state_group(layers: list[int], mamba: dict[str, Any]) -> StateGroup:
    conv_dim = mamba["intermediate"] + 2 * mamba["n_groups"] * mamba["d_state"]
    return StateGroup("mamba2", tuple(layers), (("conv", (mamba["d_conv"] - 1, conv_dim)),
                                                ("ssm", (mamba["n_heads"], mamba["head_dim"], mamba["d_state"]))))


def _limit(value) -> tuple[float, float]:
    """time_step_limit as saved: [lo, hi], where transformers writes infinity as {"__float__": "Infinity"}."""
    if value is None:
        return 0.0, float("inf")
    lo, hi = (float(v["__float__"]) if isinstance(v, dict) else float(v) for v in value)
    return lo, hi


def _need(cfg: dict[str, Any], *keys: str) -> None:
    missing = [k for k in keys if cfg.get(k) is None]
    if missing:
        raise ModelLoadError(f"config.json lacks required keys {missing}")


def _eos(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _mamba2(cfg: dict[str, Any]) -> ModelConfig:
    _need(cfg, "vocab_size", "hidden_size", "num_hidden_layers", "num_heads", "head_dim", "state_size")
    hidden, n = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
    mamba = {"n_heads": int(cfg["num_heads"]), "head_dim": int(cfg["head_dim"]), "d_state": int(cfg["state_size"]),
             "n_groups": int(cfg.get("n_groups", 8)), "d_conv": int(cfg.get("conv_kernel", 4)),
             "intermediate": int(cfg.get("d_inner") or cfg.get("expand", 2) * hidden), "conv_bias": bool(cfg.get("use_conv_bias", True)),
             "proj_bias": bool(cfg.get("use_bias", False)), "time_step_limit": _limit(cfg.get("time_step_limit")),
             "norm_eps": float(cfg.get("layer_norm_epsilon", 1e-5))}
    return ModelConfig(
        arch="mamba2", vocab_size=int(cfg["vocab_size"]), hidden_size=hidden, intermediate_size=mamba["intermediate"],
        num_layers=n, num_heads=1, num_kv_heads=1, head_dim=1, rms_norm_eps=mamba["norm_eps"],
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 8192),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos(cfg.get("eos_token_id")), extra={"mamba": mamba},
        attention_layers=[], state_groups=[mamba_state_group(list(range(n)), mamba)])


def _granite(cfg: dict[str, Any]) -> ModelConfig:
    _need(cfg, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "mamba_n_heads")
    hidden, n, heads = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"]), int(cfg["num_attention_heads"])
    types = cfg.get("layer_types") or cfg.get("layers_block_type") or ["mamba"] * n
    bad = sorted({t for t in types if t not in MAMBA_KINDS + ATTENTION_KINDS})
    if len(types) != n or bad:
        raise ModelLoadError(f"config.json layer_types must name one of {MAMBA_KINDS + ATTENTION_KINDS} for each of "
                             f"the {n} layers; got {len(types)} entries" + (f" including {bad}" if bad else ""))
    intermediate = int(cfg.get("d_inner") or cfg.get("mamba_expand", 2) * hidden)  # d_inner: a GGUF's ssm.inner_size
    d_head = cfg.get("mamba_d_head", "auto")
    d_head = intermediate // int(cfg["mamba_n_heads"]) if d_head in (None, "auto") else int(d_head)
    mamba = {"n_heads": int(cfg["mamba_n_heads"]), "head_dim": d_head, "d_state": int(cfg.get("mamba_d_state", 256)),
             "n_groups": int(cfg.get("mamba_n_groups", 1)), "d_conv": int(cfg.get("mamba_d_conv", 4)),
             "intermediate": intermediate, "conv_bias": bool(cfg.get("mamba_conv_bias", True)),
             "proj_bias": bool(cfg.get("mamba_proj_bias", False)),
             "time_step_limit": _limit(cfg.get("time_step_limit")), "norm_eps": float(cfg.get("rms_norm_eps", 1e-6))}
    rope = cfg.get("position_embedding_type") == "rope"
    params = cfg.get("rope_parameters") or {}
    extra = {"mamba": mamba, "rope": rope,
             "embedding_multiplier": float(cfg.get("embedding_multiplier", 1.0)),
             "logits_scaling": float(cfg.get("logits_scaling", 1.0)),
             "residual_multiplier": float(cfg.get("residual_multiplier", 1.0)),
             "attention_multiplier": float(cfg.get("attention_multiplier", 1.0)),
             "num_local_experts": int(cfg.get("num_local_experts") or 0),
             "num_experts_per_tok": int(cfg.get("num_experts_per_tok") or 0),
             "shared_intermediate_size": int(cfg.get("shared_intermediate_size", 1024))}
    return ModelConfig(
        arch="granitemoehybrid", vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
        intermediate_size=int(cfg.get("intermediate_size", 0)), num_layers=n, num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads), head_dim=hidden // heads,
        rope_theta=float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)), bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos(cfg.get("eos_token_id")), extra=extra,
        attention_layers=[i for i, t in enumerate(types) if t in ATTENTION_KINDS],
        state_groups=[g for g in [mamba_state_group([i for i, t in enumerate(types) if t in MAMBA_KINDS], mamba)]
                      if g.layers])


def _lfm2_intermediate(cfg: dict[str, Any]) -> int:
    """The MLP width as transformers derives it (2/3 of intermediate_size, times a multiplier, rounded up)."""
    size = int(cfg.get("intermediate_size", cfg.get("block_ff_dim", 12288)))
    if cfg.get("block_auto_adjust_ff_dim", True):
        size = int(2 * size / 3)
        multiplier, multiple = cfg.get("block_ffn_dim_multiplier", 1.0), int(cfg.get("block_multiple_of", 256))
        if multiplier is not None:
            size = multiple * ((int(multiplier * size) + multiple - 1) // multiple)
    return size


def _lfm2(cfg: dict[str, Any]) -> ModelConfig:
    _need(cfg, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
    hidden, n, heads = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"]), int(cfg["num_attention_heads"])
    types = cfg.get("layer_types")
    if types is None:
        full = cfg.get("full_attn_idxs")
        types = ["full_attention" if full is None or i in full else "conv" for i in range(n)]
    if len(types) != n or any(t not in ("conv", "full_attention") for t in types):
        raise ModelLoadError(f"config.json layer_types must name 'conv' or 'full_attention' for each of the {n} "
                             f"layers; got {types!r}")
    kernel = int(cfg.get("conv_L_cache", 3))
    params = cfg.get("rope_parameters") or {}
    convs = [i for i, t in enumerate(types) if t == "conv"]
    return ModelConfig(
        arch="lfm2", vocab_size=int(cfg["vocab_size"]), hidden_size=hidden, intermediate_size=_lfm2_intermediate(cfg),
        num_layers=n, num_heads=heads, num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=hidden // heads, rope_theta=float(cfg.get("rope_theta") or params.get("rope_theta") or 1e6),
        rms_norm_eps=float(cfg.get("norm_eps", 1e-5)), qk_norm=True,
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 128_000),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", cfg.get("tie_embedding", True))),
        bos_token_id=cfg.get("bos_token_id"), eos_token_ids=_eos(cfg.get("eos_token_id")),
        extra={"conv_L_cache": kernel, "conv_bias": bool(cfg.get("conv_bias", False))},
        attention_layers=[i for i, t in enumerate(types) if t == "full_attention"],
        state_groups=[StateGroup("short_conv", tuple(convs), (("conv", (kernel - 1, hidden)),))] if convs else [])


def _rwkv(cfg: dict[str, Any]) -> ModelConfig:
    _need(cfg, "vocab_size", "hidden_size", "num_hidden_layers")
    hidden, n = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
    att = int(cfg.get("attention_hidden_size") or hidden)
    shapes = (("att_shift", (hidden,)), ("num", (att,)), ("den", (att,)), ("max", (att,)), ("ffn_shift", (hidden,)))
    return ModelConfig(
        arch="rwkv", vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
        intermediate_size=int(cfg.get("intermediate_size") or 4 * hidden), num_layers=n, num_heads=1, num_kv_heads=1,
        head_dim=1, rms_norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
        max_position_embeddings=int(cfg.get("context_length") or 1024),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos(cfg.get("eos_token_id")),
        extra={"attention_hidden_size": att, "rescale_every": int(cfg.get("rescale_every", 6) or 0)},
        attention_layers=[], state_groups=[StateGroup("rwkv", tuple(range(n)), shapes)])


QWEN3_NEXT_KEYS = {"linear_num_value_heads": 32, "linear_num_key_heads": 16, "linear_key_head_dim": 128,
                   "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 512,
                   "num_experts_per_tok": 10, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
                   "decoder_sparse_step": 1, "norm_topk_prob": True}


def _qwen3_next(cfg: dict[str, Any]) -> ModelConfig:
    _need(cfg, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
    hidden, n, heads = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"]), int(cfg["num_attention_heads"])
    types = cfg.get("layer_types") or ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
    if len(types) != n or any(t not in ("linear_attention", "full_attention") for t in types):
        raise ModelLoadError(f"config.json layer_types must name 'linear_attention' or 'full_attention' for each of "
                             f"the {n} layers; got {types!r}")
    params = cfg.get("rope_parameters") or {}
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    partial = float(cfg.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 0.25)
    extra: dict[str, Any] = {k: cfg.get(k, default) for k, default in QWEN3_NEXT_KEYS.items()}
    extra.update(rotary_dim=int(head_dim * partial), mlp_only_layers=list(cfg.get("mlp_only_layers") or []))
    deltas = [i for i, t in enumerate(types) if t == "linear_attention"]
    conv_dim = 2 * extra["linear_num_key_heads"] * extra["linear_key_head_dim"] + (
        extra["linear_num_value_heads"] * extra["linear_value_head_dim"])
    shapes = (("conv", (extra["linear_conv_kernel_dim"] - 1, conv_dim)),
              ("delta", (extra["linear_num_value_heads"], extra["linear_key_head_dim"], extra["linear_value_head_dim"])))
    return ModelConfig(
        arch="qwen3_next", vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
        intermediate_size=int(cfg.get("intermediate_size") or 5120), num_layers=n, num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads), head_dim=head_dim,
        rope_theta=float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), qk_norm=True,
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 32768),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)), bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos(cfg.get("eos_token_id")), extra=extra,
        attention_layers=[i for i, t in enumerate(types) if t == "full_attention"],
        state_groups=[StateGroup("gated_delta", tuple(deltas), shapes)] if deltas else [])


def recurrent_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    arch = recurrent_arch(cfg)
    if arch == "qwen3_next":
        return _qwen3_next(cfg)
    if arch == "rwkv":
        return _rwkv(cfg)
    if arch == "lfm2":
        return _lfm2(cfg)
    if arch == "mamba2":
        return _mamba2(cfg)
    if arch == "granitemoehybrid":
        return _granite(cfg)
    raise ModelLoadError(f"not a recurrent architecture: model_type {cfg.get('model_type')!r}")


def recurrent_parameter_count(cfg: ModelConfig) -> int:
    """Parameters of a Mamba-2 or Granite 4.0-H model from its config (for `kvforge memory`'s weight estimate)."""
    if cfg.arch == "lfm2":
        return _lfm2_parameter_count(cfg)
    if cfg.arch == "qwen3_next":
        return _qwen3_next_parameter_count(cfg)
    if cfg.arch == "rwkv":
        h, a, i = cfg.hidden_size, cfg.extra["attention_hidden_size"], cfg.intermediate_size
        per_layer = 2 * a + 3 * h + 3 * h * a + a * h + 2 * h + h * i + h * h + i * h + 4 * h
        return cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2) + cfg.num_layers * per_layer + 4 * h
    h, m, ex = cfg.hidden_size, cfg.extra["mamba"], cfg.extra
    conv_dim = m["intermediate"] + 2 * m["n_groups"] * m["d_state"]
    mixer = (h * (m["intermediate"] + conv_dim + m["n_heads"]) + conv_dim * (m["d_conv"] + 1) + 3 * m["n_heads"]
             + m["intermediate"] + m["intermediate"] * h)
    qkv = cfg.head_dim * (cfg.num_heads + 2 * cfg.num_kv_heads)
    attention = h * qkv + cfg.num_heads * cfg.head_dim * h
    mixers = sum(len(g.layers) for g in cfg.state_groups)
    attentions = cfg.num_kv_layers
    total = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2) + h + mixers * mixer + attentions * attention
    if cfg.arch == "granitemoehybrid":
        experts = ex["num_local_experts"]
        mlp = 3 * h * ex["shared_intermediate_size"] + experts * (3 * h * cfg.intermediate_size + h)
        total += cfg.num_layers * (mlp + 2 * h)
    else:
        total += cfg.num_layers * h
    return total


def _lfm2_parameter_count(cfg: ModelConfig) -> int:
    h, kernel, bias = cfg.hidden_size, cfg.extra["conv_L_cache"], cfg.extra["conv_bias"]
    conv = h * kernel + 4 * h * h + (h + 4 * h if bias else 0)
    attention = h * cfg.head_dim * (cfg.num_heads + 2 * cfg.num_kv_heads) + cfg.num_heads * cfg.head_dim * h
    attention += 2 * cfg.head_dim
    convs = sum(len(g.layers) for g in cfg.state_groups)
    per_layer = 3 * h * cfg.intermediate_size + 2 * h
    total = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2) + h
    return total + convs * conv + cfg.num_kv_layers * attention + cfg.num_layers * per_layer


def _qwen3_next_parameter_count(cfg: ModelConfig) -> int:
    h, x, hd = cfg.hidden_size, cfg.extra, cfg.head_dim
    attention = h * hd * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) + cfg.num_heads * hd * h + 2 * hd
    kd, vd = x["linear_num_key_heads"] * x["linear_key_head_dim"], x["linear_num_value_heads"] * x["linear_value_head_dim"]
    nv = x["linear_num_value_heads"]
    delta = (h * (2 * kd + 2 * vd) + h * 2 * nv + (2 * kd + vd) * x["linear_conv_kernel_dim"] + 2 * nv
             + x["linear_value_head_dim"] + vd * h)
    moe = (x["num_experts"] * (h + 3 * h * x["moe_intermediate_size"]) + 3 * h * x["shared_expert_intermediate_size"]
           + h)
    total = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2) + h
    for i in range(cfg.num_layers):
        sparse = i not in x["mlp_only_layers"] and x["num_experts"] > 0 and (i + 1) % x["decoder_sparse_step"] == 0
        total += (attention if i in cfg.attention_layers else delta) + 2 * h
        total += moe if sparse else 3 * h * cfg.intermediate_size
    return total
