"""The model's weights in the mode the engine asked for (EngineConfig.weights), and what that mode really is."""
from __future__ import annotations

import torch

from kvforge.config import EngineConfig
from kvforge.errors import ConfigError
from kvforge.models.int8_weights import int8_loaded
from kvforge.models.loader import LoadedModel, load_model
from kvforge.models.quant_weights import holds_blocks
from kvforge.models.requantize import MODES, requantized


def weights_for(config: EngineConfig, loaded: LoadedModel | None, device: torch.device) -> tuple[LoadedModel, str]:
    """(the model in config.weights' mode, the mode for the tiers' keys: "auto" over fp32 weights computes as "fp32"
    does, over a GGUF's blocks as "auto:gguf_blocks")."""
    loaded = loaded or load_model(config.model, device, config.weights)
    if config.weights != "auto" and holds_blocks(loaded.model):  # fp32 or int8 asked of a GGUF kept in blocks
        loaded = load_model(loaded.path, device)
    mode = "auto:gguf_blocks" if holds_blocks(loaded.model) else ("fp32" if config.weights == "auto" else config.weights)
    if config.weights == "int8":
        loaded = int8_loaded(loaded)  # its own module tree with int8 linear weights
    elif config.weights in MODES:
        loaded = requantized(loaded, config.weights)  # its own module tree with Q8_0 / Q4_0 block weights
    return loaded, mode


def engine_device(config: EngineConfig, loaded: LoadedModel | None) -> torch.device:
    """Where the engine computes: config.device; unset, where a model passed in already lives (weights are never
    moved behind the caller's back), else cuda when present. A model on another device than the one asked for is
    refused with the two ways out."""
    if loaded is None or config.device is not None:
        device = config.resolve_device()
    else:
        device = model_device(loaded.model)
    if loaded is not None and not same_device(model_device(loaded.model), device):
        raise ConfigError(f"the model's weights are on {model_device(loaded.model)} and the engine's device is {device}: "
                          f"load the model there (load_model(path, device={str(device)!r})) or leave device unset")
    return device


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's first real tensor: originals kept on the meta device beside their block or int8
    form (models/int8_weights.py, quant_weights.py) hold no values and say nothing of where the model computes (a model wholly on meta is on meta)."""
    tensors = [*model.parameters(), *model.buffers()]
    tensor = next((t for t in tensors if t.device.type != "meta"), tensors[0] if tensors else None)
    return tensor.device if tensor is not None else torch.device("cpu")


def same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index or 0) == (b.index or 0)
