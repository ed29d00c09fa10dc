"""load_gguf: a GGUF file -> ModelConfig, fp32 weights under Hugging Face names, Tokenizer.

The header is parsed by `gguf_header` (every read bounds-checked, so a bad file gives a ModelLoadError, not a
struct or numpy error); tensor data is memory-mapped and dequantized by `gguf_quants` (torch) or, for other block types, `gguf.quants`.
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf.quants import dequantize

from kvforge.errors import KVForgeError, ModelLoadError
from kvforge.models.config import ModelConfig
from kvforge.models.gemma_config import GEMMA_ARCHES, GGUF_LAYER_NAMES, LAYER_NORMS, gemma_from_gguf
from kvforge.models.gguf_header import GGUFTensor, open_gguf, read_gguf_header
from kvforge.models.gguf_quants import dequantize_torch
from kvforge.models.gguf_recurrent import (
    RECURRENT_GGUF_ARCHES,
    planned_blocks,
    recurrent_config,
    recurrent_weights,
    refuse_unrun,
)
from kvforge.models.quant_weights import QuantBlocks, keeps_blocks
from kvforge.models.tokenizer import Tokenizer

_ARCHES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
           "gemma3": "gemma3"}
_PERMUTED_QK = {"llama", "mistral"}  # llama.cpp's converter interleaves q/k rows for its RoPE
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
_LAYER = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_REQUIRED = [f"{m}.weight" for m in _LAYER.values() if not m.endswith(("q_norm", "k_norm"))]
_IGNORED = {"rope_freqs.weight"}
_TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


def _to_torch(buf: Any, t: GGUFTensor) -> torch.Tensor:
    block, type_size = GGML_QUANT_SIZES[t.qtype]
    byte_shape = (*t.shape[:-1], t.shape[-1] // block * type_size) if t.shape else (type_size,)
    raw = np.frombuffer(buf, np.uint8, t.nbytes, t.start).reshape(byte_shape)
    fast = dequantize_torch(torch.from_numpy(raw.copy()), t.qtype, type_size)
    if fast is not None:
        return fast.reshape(t.shape)
    try:
        values = dequantize(raw, t.qtype)
    except NotImplementedError as e:
        raise ModelLoadError(f"tensor {t.name}: ggml type {t.qtype.name} cannot be dequantized ({e})") from e
    values = values.astype(np.float32, copy=not values.flags.writeable)
    return torch.from_numpy(values.reshape(t.shape)).contiguous()


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row interleaving, giving Hugging Face's rotate_half layout."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _hf_name(name: str, arch: str) -> str | None:
    if name in _GLOBAL:
        return _GLOBAL[name]
    layer_names = {**_LAYER, **GGUF_LAYER_NAMES} if arch in GEMMA_ARCHES else _LAYER
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}"
    return None


def _config(path: str, meta: dict[str, Any], tensors: dict[str, GGUFTensor], tok: Tokenizer | None) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in _ARCHES:
        raise ModelLoadError(f"{path}: architecture {arch!r} is not supported; supported: "
                             f"{sorted(_ARCHES) + list(RECURRENT_GGUF_ARCHES)}")

    def num(key: str, default: Any = None, kind: type = int) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{path}: metadata lacks {arch}.{key}, which every {arch} GGUF must state")
        if isinstance(value, (bool, str, list)) or not value > 0:
            raise ModelLoadError(f"{path}: metadata {arch}.{key} is {value!r}, expected a positive number")
        return kind(value)

    if "token_embd.weight" not in tensors or len(tensors["token_embd.weight"].shape) != 2:
        raise ModelLoadError(f"{path}: no 2-D token_embd.weight tensor; a {arch} GGUF must have one")
    hidden, heads = num("embedding_length"), num("attention.head_count")
    kv_heads = num("attention.head_count_kv", heads)
    if heads % kv_heads:
        raise ModelLoadError(f"{path}: {heads} attention heads cannot share {kv_heads} kv heads evenly")
    scaling = meta.get(f"{arch}.rope.scaling.type")
    head_dim = num("attention.key_length", max(hidden // heads, 1))
    fields = {
        "qk_norm": "blk.0.attn_q_norm.weight" in tensors,
        "sliding_window": meta.get(f"{arch}.attention.sliding_window"),
        **(gemma_from_gguf(meta, arch, num("block_count"), head_dim) if arch in GEMMA_ARCHES else {}),
    }
    return ModelConfig(
        arch=_ARCHES[arch],
        vocab_size=tensors["token_embd.weight"].shape[0],
        hidden_size=hidden,
        intermediate_size=num("feed_forward_length"),
        num_layers=num("block_count"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=num("rope.freq_base", 10000.0, float),
        rms_norm_eps=num("attention.layer_norm_rms_epsilon", kind=float),
        max_position_embeddings=num("context_length", 4096),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        rope_scaling=None if scaling in (None, "none") else {
            "rope_type": scaling,
            "factor": num("rope.scaling.factor", 1.0, float),
            "original_max_position_embeddings": meta.get(f"{arch}.rope.scaling.original_context_length"),
        },
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=_eos_ids(meta, tok),
        **fields,
    )


def _expected_shape(hf: str, cfg: ModelConfig) -> tuple[int, ...] | None:
    """The Hugging Face shape a tensor of this name has in a model of this config; None if it has no place."""
    h, q, kv, d = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.head_dim
    top = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,), "lm_head.weight": (cfg.vocab_size, h)}
    if hf in top:
        return top[hf]
    _, _, layer, rest = hf.split(".", 3)
    if int(layer) >= cfg.num_layers:
        return None
    return {
        **{norm: (h,) for norm in LAYER_NORMS},
        "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q), "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.bias": (kv,), "self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,),
        "mlp.gate_proj.weight": (cfg.intermediate_size, h), "mlp.up_proj.weight": (cfg.intermediate_size, h),
        "mlp.down_proj.weight": (h, cfg.intermediate_size),
    }.get(rest)


def _check_tensors(path: str, cfg: ModelConfig, names: dict[str, GGUFTensor]) -> None:
    """Every tensor is one this config expects, with the shape it expects, and none it needs is missing."""
    for hf, t in names.items():
        shape = _expected_shape(hf, cfg)
        if shape is None:
            raise ModelLoadError(f"{path}: tensor {t.name} does not belong to a {cfg.num_layers}-layer {cfg.arch} model")
        if t.shape != shape:
            raise ModelLoadError(f"{path}: tensor {t.name} has shape {list(t.shape)}, expected {list(shape)} "
                                 f"from the file's metadata")
    layers = {int(n.split(".")[2]) for n in names if n.startswith("model.layers.")}
    needed = ["model.embed_tokens.weight", "model.norm.weight"]
    if len(layers) != cfg.num_layers:
        needed.append(f"model.layers.{min(set(range(len(layers) + 1)) - layers)}.*")
    else:
        required = _REQUIRED + list(LAYER_NORMS) if cfg.arch in GEMMA_ARCHES else _REQUIRED
        needed += [f"model.layers.{i}.{r}" for i in range(cfg.num_layers) for r in required]
    missing = [n for n in needed if n not in names]
    if missing:
        raise ModelLoadError(f"{path}: the file lacks tensors a {cfg.num_layers}-layer {cfg.arch} model needs, "
                             f"e.g. {missing[:3]}")


def _eos_ids(meta: dict[str, Any], tok: Tokenizer | None) -> list[int]:
    """The eos id, llama.cpp's end-of-turn ids, and turn-end tokens the chat template writes (None: no tokenizer)."""
    ids = [meta.get(f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
    template = (tok.chat_template if tok is not None else None) or ""
    ids += [tok.token_to_id(t) for t in _TURN_END_TOKENS if t in template]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


def load_gguf(path: str | os.PathLike[str]) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """Load a GGUF model: its config, its weights (fp32, contiguous, HF Llama names and shapes), its tokenizer."""
    config, weights, _, tokenizer = _guarded(os.fspath(path), False)
    return config, weights, tokenizer


def load_gguf_blocks(path: str | os.PathLike[str]) -> tuple[ModelConfig, dict[str, torch.Tensor],
                                                             dict[str, QuantBlocks], Tokenizer]:
    """load_gguf keeping every 2-D tensor of a block type computed in place (models/quant_weights.py) as its block
    bytes, not dequantized: those come back as QuantBlocks (rows in Hugging Face order), with meta placeholders of
    their fp32 shapes among the weights."""
    return _guarded(os.fspath(path), True)


def block_table(path: str | os.PathLike[str]) -> dict[str, QuantBlocks]:
    """The tensors load_gguf_blocks would keep in blocks, from the header alone: QuantBlocks on the meta device
    (their byte shapes, no data), by Hugging Face name."""
    path = os.fspath(path)
    meta, table = read_gguf_header(path, open_gguf(path))
    arch = meta.get("general.architecture")
    if arch in RECURRENT_GGUF_ARCHES:
        return planned_blocks(arch, table)
    out = {}
    for t in table:
        hf = _hf_name(t.name, arch)
        if hf is not None and keeps_blocks(int(t.qtype), t.shape):
            block, type_size = GGML_QUANT_SIZES[t.qtype]
            data = torch.empty(t.shape[0], t.shape[1] // block * type_size, dtype=torch.uint8, device="meta")
            out[hf] = QuantBlocks(int(t.qtype), data)
    return out


def _guarded(path: str, keep_blocks: bool):
    try:
        return _load(path, open_gguf(path), keep_blocks)
    except KVForgeError:
        raise
    except Exception as e:  # metadata of the wrong type, a tokenizer that will not build: still a bad file
        raise ModelLoadError(f"{path}: corrupt or unsupported GGUF ({type(e).__name__}: {e})") from e


def _raw_rows(buf: Any, t: GGUFTensor) -> torch.Tensor:
    """A 2-D block tensor's bytes as uint8 [rows, row bytes] (a copy out of the mapping)."""
    block, type_size = GGML_QUANT_SIZES[t.qtype]
    raw = np.frombuffer(buf, np.uint8, t.nbytes, t.start).reshape(t.shape[0], t.shape[1] // block * type_size)
    return torch.from_numpy(raw.copy())


def _load(path: str, buf: Any, keep_blocks: bool = False):
    meta, table = read_gguf_header(path, buf)
    tensors = {t.name: t for t in table}
    refuse_unrun(path, meta.get("general.architecture"))
    tokenizer = Tokenizer.from_gguf_metadata(meta)
    if meta["general.architecture"] in RECURRENT_GGUF_ARCHES:
        return _load_recurrent(path, buf, meta, tensors, tokenizer, keep_blocks)
    config = _config(path, meta, tensors, tokenizer)
    arch = meta["general.architecture"]
    unknown = [n for n in tensors if _hf_name(n, arch) is None and n not in _IGNORED]
    if unknown:
        raise ModelLoadError(f"{path}: tensors {unknown[:5]} have no known Hugging Face name for {config.arch}")
    named = {_hf_name(n, arch): t for n, t in tensors.items() if n not in _IGNORED}
    _check_tensors(path, config, named)
    permuted = arch in _PERMUTED_QK
    weights: dict[str, torch.Tensor] = {}
    blocks: dict[str, QuantBlocks] = {}
    for hf, t in named.items():
        if keep_blocks and keeps_blocks(int(t.qtype), t.shape):
            rows = _raw_rows(buf, t)
            if permuted and hf.endswith(("q_proj.weight", "k_proj.weight")):
                rows = _unpermute(rows, config.num_heads if "q_proj" in hf else config.num_kv_heads).contiguous()
            blocks[hf] = QuantBlocks(int(t.qtype), rows)
            weights[hf] = torch.empty(t.shape, device="meta")
            continue
        w = _to_torch(buf, t)
        if permuted and hf.endswith(("q_proj.weight", "k_proj.weight")):
            w = _unpermute(w, config.num_heads if "q_proj" in hf else config.num_kv_heads).contiguous()
        if arch in GEMMA_ARCHES and hf.endswith("norm.weight"):
            w -= 1.0  # llama.cpp stores Gemma's norm weights as 1 + w; Hugging Face names hold w
        weights[hf] = w
    return config, weights, blocks, tokenizer


def _load_recurrent(path: str, buf: Any, meta: dict[str, Any], tensors: dict[str, GGUFTensor], tokenizer: Tokenizer,
                    keep_blocks: bool):
    arch = meta["general.architecture"]
    shapes = {n: t.shape for n, t in tensors.items()}
    config = recurrent_config(path, arch, meta, shapes, _eos_ids(meta, tokenizer))
    weights, blocks = recurrent_weights(path, arch, config, tensors, keep_blocks, lambda t: _to_torch(buf, t),
                                        lambda t: _raw_rows(buf, t), _unpermute)
    return config, weights, blocks, tokenizer


def read_gguf_config(path: str | os.PathLike[str]) -> tuple[ModelConfig, list[GGUFTensor]]:
    """A GGUF's config exactly as load_gguf reads it, and its tensor table, from the header alone (the memory
    calculator's reader too); a file without tokenizer metadata gets the config without turn-end ids."""
    path = os.fspath(path)
    try:
        meta, table = read_gguf_header(path, open_gguf(path))
        arch = meta.get("general.architecture")
        refuse_unrun(path, arch)
        tok = Tokenizer.from_gguf_metadata(meta) if "tokenizer.ggml.tokens" in meta else None
        if arch in RECURRENT_GGUF_ARCHES:
            return recurrent_config(path, arch, meta, {t.name: t.shape for t in table}, _eos_ids(meta, tok)), table
        return _config(path, meta, {t.name: t for t in table}, tok), table
    except KVForgeError:
        raise
    except Exception as e:
        raise ModelLoadError(f"{path}: corrupt or unsupported GGUF metadata ({type(e).__name__}: {e})") from e


def load_gguf_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """Only the tokenizer of a GGUF file (reads the header, not the weights)."""
    path = os.fspath(path)
    try:
        return Tokenizer.from_gguf_metadata(read_gguf_header(path, open_gguf(path))[0])
    except KVForgeError:
        raise
    except Exception as e:
        raise ModelLoadError(f"{path}: corrupt or unsupported GGUF tokenizer ({type(e).__name__}: {e})") from e
