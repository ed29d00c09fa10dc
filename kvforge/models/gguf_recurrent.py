"""GGUF files of the recurrent and hybrid architectures llama.cpp converts: `lfm2` (Lfm2ForCausalLM), `mamba2`
(Mamba2ForCausalLM) and `granitehybrid` (GraniteMoeHybridForCausalLM: Granite 4.0-H, Bamba).

The metadata becomes the config.json fields models/recurrent_config.py reads, and each tensor gets its Hugging Face
name back with llama.cpp's conversion (convert_hf_to_gguf.py) undone:
- Mamba-2 mixers: `ssm_a` holds A = -exp(A_log) as [heads, 1] (A_log = log(-A)), `ssm_d` D as [heads, 1],
  `ssm_norm` the gated norm's weight as [groups, inner / groups], `ssm_conv1d` the depthwise kernel squeezed to
  [channels, taps], `ssm_dt.bias` is dt_bias; which layers are mixers the tensors say (`blk.N.ssm_in`).
- LFM2: `shortconv.conv` squeezed to [hidden, taps]; the final norm is `token_embd_norm`; conv layers are those
  with `shortconv.in_proj` (the converter writes head_count_kv 0 there).
- Granite 4.0-H: the MoE's fused gate/up experts are split into `ffn_gate_exps` / `ffn_up_exps`, the shared MLP's
  into `ffn_gate_shexp` / `ffn_up_shexp` (`ffn_gate` / `ffn_up` / `ffn_down` without experts), q/k rows interleaved
  for llama.cpp's RoPE (LlamaModel.permute); muP multipliers as `embedding_scale`, `residual_scale`,
  `attention.scale`, `logit_scale`; RoPE only where `rope.scaling.finetuned` is set (Bamba).
Split parts are fused again; 2-D parts kept in their GGUF blocks (weights="auto") fuse by concatenating their
blocks when they share a type.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvforge.errors import ModelLoadError
from kvforge.models.config import ModelConfig
from kvforge.models.quant_weights import QuantBlocks, keeps_blocks
from kvforge.models.recurrent_config import recurrent_from_hf

RECURRENT_GGUF_ARCHES = ("lfm2", "mamba2", "granitehybrid")
_NOT_RUN = {
    "rwkv6": "RWKV-6", "rwkv7": "RWKV-7", "rwkv6qwen2": "RWKV-6 (Qwen2 hybrid)", "arwkv7": "RWKV-7 (ARWKV)",
}
_PREFIX = {"lfm2": "model.layers", "mamba2": "backbone.layers", "granitehybrid": "model.layers"}
_GLOBAL = {
    "lfm2": {"token_embd": "model.embed_tokens", "token_embd_norm": "model.embedding_norm", "output": "lm_head"},
    "mamba2": {"token_embd": "backbone.embeddings", "output_norm": "backbone.norm_f", "output": "lm_head"},
    "granitehybrid": {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"},
}
_MIXER = {"ssm_in": "in_proj", "ssm_conv1d": "conv1d", "ssm_dt": "dt_bias", "ssm_a": "A_log", "ssm_d": "D",
          "ssm_norm": "norm", "ssm_out": "out_proj"}
# GGUF layer tensor -> (Hugging Face module path, part of a fused tensor: 0 gate, 1 up, None whole)
_LAYER: dict[str, dict[str, tuple[str, int | None]]] = {
    "lfm2": {
        "attn_norm": ("operator_norm", None), "ffn_norm": ("ffn_norm", None),
        "ffn_gate": ("feed_forward.w1", None), "ffn_up": ("feed_forward.w3", None),
        "ffn_down": ("feed_forward.w2", None), "shortconv.conv": ("conv.conv", None),
        "shortconv.in_proj": ("conv.in_proj", None), "shortconv.out_proj": ("conv.out_proj", None),
        "attn_q": ("self_attn.q_proj", None), "attn_k": ("self_attn.k_proj", None),
        "attn_v": ("self_attn.v_proj", None), "attn_output": ("self_attn.out_proj", None),
        "attn_q_norm": ("self_attn.q_layernorm", None), "attn_k_norm": ("self_attn.k_layernorm", None),
    },
    "mamba2": {"attn_norm": ("norm", None), **{k: (f"mixer.{v}", None) for k, v in _MIXER.items()}},
    "granitehybrid": {
        "attn_norm": ("input_layernorm", None), "ffn_norm": ("post_attention_layernorm", None),
        **{k: (f"mamba.{v}", None) for k, v in _MIXER.items()},
        "attn_q": ("self_attn.q_proj", None), "attn_k": ("self_attn.k_proj", None),
        "attn_v": ("self_attn.v_proj", None), "attn_output": ("self_attn.o_proj", None),
        "ffn_gate_inp": ("block_sparse_moe.router.layer", None),
        "ffn_gate_exps": ("block_sparse_moe.input_linear", 0), "ffn_up_exps": ("block_sparse_moe.input_linear", 1),
        "ffn_down_exps": ("block_sparse_moe.output_linear", None),
        "ffn_gate_shexp": ("shared_mlp.input_linear", 0), "ffn_up_shexp": ("shared_mlp.input_linear", 1),
        "ffn_down_shexp": ("shared_mlp.output_linear", None),
        "ffn_gate": ("shared_mlp.input_linear", 0), "ffn_up": ("shared_mlp.input_linear", 1),
        "ffn_down": ("shared_mlp.output_linear", None),
    },
}
_RESHAPED = ("ssm_a", "ssm_d", "ssm_norm", "ssm_conv1d", "shortconv.conv")  # never kept in blocks


def refuse_unrun(path: str, arch: Any) -> None:
    """A GGUF architecture kvforge knows it cannot run, with why (before its tokenizer is read)."""
    if arch in _NOT_RUN:
        raise ModelLoadError(
            f"{path}: GGUF architecture {arch!r} is {_NOT_RUN[arch]}; kvforge's RwkvForCausalLM is RWKV-4, which "
            "llama.cpp does not convert (it has RWKV-6 and RWKV-7 only), so no RWKV GGUF can be run: load an RWKV-4 "
            "model from its Hugging Face directory (config.json + safetensors)")
    if arch == "qwen3next":
        raise ModelLoadError(f"{path}: GGUF architecture 'qwen3next' is not supported yet; load Qwen3-Next from its "
                             "Hugging Face directory (config.json + safetensors)")


def gguf_hf_name(name: str, arch: str) -> tuple[str, int | None, str] | None:
    """(Hugging Face name, fused part or None, the GGUF tensor kind) of a GGUF tensor name, or None if unknown."""
    base, _, suffix = name.rpartition(".") if name.endswith((".weight", ".bias")) else (name, "", "")
    if base in _GLOBAL[arch]:
        return f"{_GLOBAL[arch][base]}.{suffix}", None, base
    parts = base.split(".", 2)
    if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    kind = parts[2]
    if kind not in _LAYER[arch]:
        return None
    module, part = _LAYER[arch][kind]
    hf = f"{_PREFIX[arch]}.{parts[1]}.{module}"
    if kind in ("ssm_a", "ssm_d"):  # parameters, stored without a suffix
        return (hf, part, kind) if not suffix else None
    if kind == "ssm_dt":  # dt_bias, stored as ssm_dt.bias
        return (hf, part, kind) if suffix == "bias" else None
    return (f"{hf}.{suffix}", part, kind) if suffix else None


def recurrent_config(path: str, arch: str, meta: dict[str, Any], shapes: dict[str, tuple[int, ...]],
                     eos_ids: list[int]) -> ModelConfig:
    """The ModelConfig of a GGUF file of these architectures, from its metadata and its tensors' names and shapes."""

    def num(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{path}: metadata lacks {arch}.{key}, which every {arch} GGUF must state")
        return value

    if len(shapes.get("token_embd.weight", ())) != 2:
        raise ModelLoadError(f"{path}: no 2-D token_embd.weight tensor; a {arch} GGUF must have one")
    n = int(num("block_count"))
    hidden = int(num("embedding_length"))
    common = {"vocab_size": shapes["token_embd.weight"][0], "hidden_size": hidden, "num_hidden_layers": n,
              "max_position_embeddings": int(num("context_length", 4096)),
              "tie_word_embeddings": "output.weight" not in shapes, "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
              "eos_token_id": eos_ids, "rope_theta": float(num("rope.freq_base", 10000.0))}
    kv = num("attention.head_count_kv", 0)
    kv_heads = max(kv) if isinstance(kv, list) else int(kv)
    if arch == "lfm2":
        convs = [i for i in range(n) if f"blk.{i}.shortconv.in_proj.weight" in shapes]
        cfg = {"model_type": "lfm2", "intermediate_size": int(num("feed_forward_length")),
               "block_auto_adjust_ff_dim": False, "num_attention_heads": int(num("attention.head_count")),
               "num_key_value_heads": kv_heads, "conv_L_cache": int(num("shortconv.l_cache")),
               "layer_types": ["conv" if i in convs else "full_attention" for i in range(n)],
               "conv_bias": bool(convs) and f"blk.{convs[0]}.shortconv.in_proj.bias" in shapes,
               "norm_eps": float(num("attention.layer_norm_rms_epsilon"))}
        return recurrent_from_hf({**common, **cfg})
    inner, heads = int(num("ssm.inner_size")), int(num("ssm.time_step_rank"))
    mixers = [i for i in range(n) if f"blk.{i}.ssm_in.weight" in shapes]
    first = mixers[0] if mixers else 0
    mamba = {"d_inner": inner, "state_size": int(num("ssm.state_size")), "n_groups": int(num("ssm.group_count", 1)),
             "conv_kernel": int(num("ssm.conv_kernel")), "use_conv_bias": f"blk.{first}.ssm_conv1d.bias" in shapes,
             "use_bias": f"blk.{first}.ssm_in.bias" in shapes}
    eps = float(num("attention.layer_norm_rms_epsilon"))
    if arch == "mamba2":
        return recurrent_from_hf({**common, **mamba, "model_type": "mamba2", "num_heads": heads,
                                  "head_dim": inner // heads, "layer_norm_epsilon": eps})
    attention = [i for i in range(n) if i not in mixers]
    gate = shapes.get(f"blk.{first}.ffn_gate_shexp.weight") or shapes.get(f"blk.{first}.ffn_gate.weight") or (0,)
    cfg = {"model_type": "granitemoehybrid", "intermediate_size": int(num("feed_forward_length", 0)),
           "num_attention_heads": int(num("attention.head_count")), "num_key_value_heads": kv_heads,
           "layer_types": ["mamba" if i in mixers else "attention" for i in range(n)],
           "mamba_n_heads": heads, "mamba_d_head": inner // heads, "mamba_d_state": mamba["state_size"],
           "mamba_n_groups": mamba["n_groups"], "mamba_d_conv": mamba["conv_kernel"], "d_inner": inner,
           "mamba_conv_bias": mamba["use_conv_bias"], "mamba_proj_bias": mamba["use_bias"],
           "position_embedding_type": "rope" if meta.get(f"{arch}.rope.scaling.finetuned") else None,
           "rms_norm_eps": eps, "embedding_multiplier": float(num("embedding_scale", 1.0)),
           "logits_scaling": float(num("logit_scale", 1.0)), "residual_multiplier": float(num("residual_scale", 1.0)),
           "attention_multiplier": float(num("attention.scale", 1.0)),
           "num_local_experts": int(num("expert_count", 0)), "num_experts_per_tok": int(num("expert_used_count", 0)),
           "shared_intermediate_size": int(num("expert_shared_feed_forward_length", gate[0])),
           "attention_bias": bool(attention) and f"blk.{attention[0]}.attn_q.bias" in shapes}
    return recurrent_from_hf({**common, **cfg})


def _undo(kind: str, w: torch.Tensor) -> torch.Tensor:
    """llama.cpp's transform of one tensor undone (on fp32 values)."""
    if kind == "ssm_a":
        return torch.log(-w).reshape(-1)
    if kind in ("ssm_d", "ssm_norm"):
        return w.reshape(-1).contiguous()
    if kind in ("ssm_conv1d", "shortconv.conv") and w.dim() == 2:
        return w.unsqueeze(1).contiguous()
    return w


def recurrent_weights(path: str, arch: str, cfg: ModelConfig, tensors: dict[str, Any], keep_blocks: bool,
                      fp32: Callable[[Any], torch.Tensor], rows: Callable[[Any], torch.Tensor],
                      unpermute: Callable[[torch.Tensor, int], torch.Tensor]) -> tuple[dict, dict]:
    """Hugging Face weights (fp32, meta placeholders for those kept in blocks) and their QuantBlocks, from the GGUF
    tensors; `fp32(t)` dequantizes one, `rows(t)` gives a 2-D block tensor's bytes."""
    unknown = [n for n in tensors if gguf_hf_name(n, arch) is None]
    if unknown:
        raise ModelLoadError(f"{path}: tensors {unknown[:5]} have no known Hugging Face name for a {arch} model")
    grouped: dict[str, dict[int | None, tuple[str, Any]]] = {}
    for name, t in tensors.items():
        hf, part, kind = gguf_hf_name(name, arch)
        if part in grouped.setdefault(hf, {}):
            raise ModelLoadError(f"{path}: two tensors give {hf} (part {part}); the second is {name}")
        grouped[hf][part] = (kind, t)
    weights: dict[str, torch.Tensor] = {}
    blocks: dict[str, QuantBlocks] = {}
    for hf, parts in grouped.items():
        if set(parts) not in ({None}, {0, 1}):
            raise ModelLoadError(f"{path}: {hf} needs both its gate and up tensors; the file has part {set(parts)}")
        ordered = [parts[p] for p in sorted(parts, key=lambda p: -1 if p is None else p)]
        heads = _permuted_heads(arch, hf, cfg)
        kept = [keep_blocks and kind not in _RESHAPED and keeps_blocks(int(t.qtype), t.shape) for kind, t in ordered]
        if all(kept) and len({int(t.qtype) for _, t in ordered}) == 1:
            data = torch.cat([rows(t) for _, t in ordered])
            if heads:
                data = unpermute(data, heads).contiguous()
            blocks[hf] = QuantBlocks(int(ordered[0][1].qtype), data)
            weights[hf] = torch.empty(sum(t.shape[0] for _, t in ordered), ordered[0][1].shape[1], device="meta")
            continue
        w = torch.cat([_undo(kind, fp32(t)) for kind, t in ordered], dim=-2) if len(ordered) > 1 else (
            _undo(ordered[0][0], fp32(ordered[0][1])))
        weights[hf] = unpermute(w, heads).contiguous() if heads else w
    return weights, blocks


def _permuted_heads(arch: str, hf: str, cfg: ModelConfig) -> int:
    """Heads whose q/k rows llama.cpp interleaved in this tensor (Granite's attention layers), else 0."""
    if arch != "granitehybrid" or not hf.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
        return 0
    return cfg.num_heads if ".q_proj." in hf else cfg.num_kv_heads


def planned_blocks(arch: str, table: list[Any]) -> dict[str, QuantBlocks]:
    """The tensors recurrent_weights would keep in blocks, from the tensor table alone (meta-device bytes)."""
    from gguf import GGML_QUANT_SIZES

    grouped: dict[str, list[Any]] = {}
    for t in table:
        named = gguf_hf_name(t.name, arch)
        if named is not None and named[2] not in _RESHAPED:
            grouped.setdefault(named[0], []).append(t)
    out = {}
    for hf, parts in grouped.items():
        if all(keeps_blocks(int(t.qtype), t.shape) for t in parts) and len({int(t.qtype) for t in parts}) == 1:
            block, type_size = GGML_QUANT_SIZES[parts[0].qtype]
            n = sum(t.shape[0] for t in parts)
            data = torch.empty(n, parts[0].shape[1] // block * type_size, dtype=torch.uint8, device="meta")
            out[hf] = QuantBlocks(int(parts[0].qtype), data)
    return out
