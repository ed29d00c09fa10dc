"""A Hugging Face directory of a tiny LFM2, Mamba-2 or Granite 4.0-H model written as GGUF the way llama.cpp's
convert_hf_to_gguf.py writes it (LFM2Model, Mamba2Model, GraniteHybridModel): its metadata keys, gguf-py's tensor
names (TensorNameMap), A_log -> A = -exp(A_log) as [heads, 1], D as [heads, 1], the gated norm as [groups, inner /
groups], convolutions squeezed to 2-D, Granite's fused gate/up split and q/k rows permuted, norms / 1-D / conv /
router tensors in F32 and the other weights in `qtype` (rows not whole blocks stay F32)."""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize
from safetensors.torch import load_file

ARCHES = {"Lfm2ForCausalLM": gguf.MODEL_ARCH.LFM2, "Mamba2ForCausalLM": gguf.MODEL_ARCH.MAMBA2,
          "GraniteMoeHybridForCausalLM": gguf.MODEL_ARCH.GRANITE_HYBRID}
F32_KINDS = (gguf.MODEL_TENSOR.FFN_GATE_INP, gguf.MODEL_TENSOR.SSM_CONV1D, gguf.MODEL_TENSOR.SHORTCONV_CONV)


def vocabulary(n: int) -> list[str]:
    return ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *[chr(c) for c in range(33, 33 + n - 3)]]


def permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """LlamaModel.permute: q/k rows interleaved for llama.cpp's RoPE."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def convert(directory: Path, out: Path, qtype: Q = Q.F32) -> Path:
    cfg = json.loads((directory / "config.json").read_text())
    hf_arch = cfg["architectures"][0]
    arch = ARCHES[hf_arch]
    n = cfg["num_hidden_layers"]
    w = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    w.add_block_count(n)
    w.add_embedding_length(cfg["hidden_size"])
    w.add_vocab_size(cfg["vocab_size"])
    tensors = load_file(directory / "model.safetensors")
    if hf_arch == "Lfm2ForCausalLM":
        named = _lfm2(w, cfg)
    elif hf_arch == "Mamba2ForCausalLM":
        named = _mamba2(w, cfg, tensors)
    else:
        named = _granite(w, cfg, tensors)
    name_map = gguf.get_tensor_name_map(arch, n)
    for name, t in named(tensors):
        new = name if name.startswith("blk.") else name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new is not None, name
        data = t.float().numpy()
        kind_f32 = any(new.startswith(gguf.TENSOR_NAMES[k].format(bid=b)) for k in F32_KINDS for b in range(n))
        keep_f32 = data.ndim <= 1 or new.endswith("_norm.weight") or kind_f32 or not new.endswith(".weight")
        this = Q.F32 if keep_f32 or data.shape[-1] % 32 else qtype
        stored = data if this == Q.F32 else quantize(data, this)
        w.add_tensor(new, stored, raw_dtype=None if this == Q.F32 else this)
    tokens = vocabulary(cfg["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    w.add_token_merges([])
    w.add_bos_token_id(1)
    w.add_eos_token_id(0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _lfm2(w: gguf.GGUFWriter, cfg: dict):
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv([cfg["num_key_value_heads"] if t != "conv" else 0 for t in cfg["layer_types"]])
    w.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    w.add_shortconv_l_cache(cfg["conv_L_cache"])
    w.add_layer_norm_rms_eps(cfg["norm_eps"])
    ff = cfg.get("block_ff_dim") or cfg["intermediate_size"]
    if cfg["block_auto_adjust_ff_dim"]:
        ff = int(2 * ff / 3)
        if cfg["block_ffn_dim_multiplier"] is not None:
            ff = int(cfg["block_ffn_dim_multiplier"] * ff)
        ff = cfg["block_multiple_of"] * ((ff + cfg["block_multiple_of"] - 1) // cfg["block_multiple_of"])
    w.add_feed_forward_length(ff)

    def named(tensors):
        for name, t in tensors.items():
            yield name, t.squeeze(1) if "conv.conv.weight" in name else t

    return named


def _mamba_tensor(name: str, t: torch.Tensor, cfg: dict, inner: int, groups: int):
    """Mamba2Model.modify_tensors for one mixer tensor: (the name the tensor map reads, the data written)."""
    if name.endswith(".dt_bias"):
        name = name.rpartition(".dt_bias")[0] + ".dt_proj.bias"
    if "conv1d.weight" in name:
        t = t.squeeze()
    elif name.endswith((".A_log", ".D")):
        t = t.reshape((*t.shape, 1))
    elif name.endswith("norm.weight") and (".mixer." in name or ".mamba." in name):
        t = t.reshape(groups, inner // groups)
    if name.endswith(".A_log"):
        t = -torch.exp(t)
    return name, t


def _mamba2(w: gguf.GGUFWriter, cfg: dict, tensors):
    hidden, head_dim = cfg["hidden_size"], cfg["head_dim"]
    inner, groups = cfg.get("expand", 2) * hidden, cfg.get("n_groups", 1)
    w.add_context_length(2**20)
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_ssm_conv_kernel(cfg.get("conv_kernel", 4))
    w.add_ssm_inner_size(inner)
    w.add_ssm_state_size(cfg["state_size"])
    w.add_ssm_time_step_rank(inner // head_dim)
    w.add_ssm_group_count(groups)
    w.add_layer_norm_rms_eps(cfg.get("layer_norm_epsilon", 1e-5))

    def named(tensors):
        for name, t in tensors.items():
            yield _mamba_tensor(name, t, cfg, inner, groups)

    return named


def _granite(w: gguf.GGUFWriter, cfg: dict, tensors):
    """GraniteHybridModel: Granite's muP scales, the Mamba-2 keys, head_count_kv per layer; RoPE (written as
    rope.scaling.finetuned, which llama.cpp's converter sets for Bamba's layout) where the config asks for it."""
    n, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    attention = [i for i, t in enumerate(cfg["layer_types"]) if t in ("attention", "full_attention")]
    inner, groups = cfg["mamba_expand"] * hidden, cfg["mamba_n_groups"]
    use_rope = cfg.get("position_embedding_type") == "rope"
    w.add_context_length(cfg["max_position_embeddings"] if use_rope else 2**20)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv([cfg["num_key_value_heads"] if i in attention else 0 for i in range(n)])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(hidden // cfg["num_attention_heads"])
    if cfg.get("num_local_experts"):
        w.add_expert_count(cfg["num_local_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_attention_scale(cfg["attention_multiplier"])
    w.add_embedding_scale(cfg["embedding_multiplier"])
    w.add_residual_scale(cfg["residual_multiplier"])
    w.add_logit_scale(cfg["logits_scaling"])
    w.add_expert_shared_feed_forward_length(cfg["shared_intermediate_size"])
    w.add_ssm_conv_kernel(cfg["mamba_d_conv"])
    w.add_ssm_state_size(cfg["mamba_d_state"])
    w.add_ssm_group_count(groups)
    w.add_ssm_inner_size(inner)
    w.add_ssm_time_step_rank(cfg["mamba_n_heads"])
    w.add_rope_scaling_finetuned(use_rope)
    experts = bool(cfg.get("num_local_experts"))
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def named(tensors):
        for name, t in tensors.items():
            bid = int(name.split(".")[2]) if name.startswith("model.layers.") else None
            if name.endswith("block_sparse_moe.input_linear.weight"):
                gate, up = t.split(cfg["intermediate_size"], dim=-2)
                yield f"blk.{bid}.ffn_gate_exps.weight", gate
                yield f"blk.{bid}.ffn_up_exps.weight", up
            elif name.endswith("shared_mlp.input_linear.weight"):
                gate, up = t.split(cfg["shared_intermediate_size"], dim=-2)
                yield f"blk.{bid}.ffn_gate{'_shexp' if experts else ''}.weight", gate
                yield f"blk.{bid}.ffn_up{'_shexp' if experts else ''}.weight", up
            elif name.endswith("shared_mlp.output_linear.weight"):
                yield f"blk.{bid}.ffn_down{'_shexp' if experts else ''}.weight", t
            elif name.endswith("block_sparse_moe.output_linear.weight"):
                yield f"blk.{bid}.ffn_down_exps.weight", t
            elif name.endswith("block_sparse_moe.router.layer.weight"):
                yield f"blk.{bid}.ffn_gate_inp.weight", t
            elif name.endswith("q_proj.weight"):
                yield name, permute(t, heads)
            elif name.endswith("k_proj.weight"):
                yield name, permute(t, kv_heads)
            else:
                yield _mamba_tensor(name, t, cfg, inner, groups)

    return named


def rwkv6_stub(out: Path) -> Path:
    """A GGUF header of llama.cpp's rwkv6 architecture (one tensor), its tokenizer of kind 'rwkv'."""
    w = gguf.GGUFWriter(str(out), "rwkv6")
    w.add_block_count(1)
    w.add_tokenizer_model("rwkv")
    w.add_token_list(vocabulary(8))
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
