"""Read Hugging Face model directories: config.json + *.safetensors (+ tokenizer.json)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from kvforge.errors import ModelLoadError


def read_config_json(directory: Path) -> dict:
    path = directory / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{directory} has no config.json; a model directory needs config.json and *.safetensors") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from None


def load_safetensors_dir(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{directory} has no *.safetensors weight files")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            for name, t in load_file(str(f)).items():
                weights[name] = t.float().contiguous()
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise ModelLoadError(f"{f} is truncated or corrupt (not a valid safetensors file): {e}") from None
    return weights
