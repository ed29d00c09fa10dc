"""Per-model KV format defaults: the options a model needs where a format's own defaults miss its quality goal.

Each format's defaults were chosen on SmolLM2-135M's evaluation panel (docs/results.md). Where another model
misses a goal with them, the options that meet it on that model's panel (held-out text included) are recorded
here, keyed by the model's architecture and hidden size, and used whenever that format is asked for on that model;
options the user gives win over them key by key.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelKVDefaults:
    arch: str  # ModelConfig.arch
    hidden_size: int
    formats: dict[str, dict] = field(default_factory=dict)  # format name -> options
    measured: str = ""  # where the choice comes from


MODEL_KV_DEFAULTS = [
    ModelKVDefaults("gemma3", 640, {"int8": {"window": 16}, "kivi2": {"window": 256}},
                    "Gemma 3 270M on the panel at 4,096 tokens (docs/results.md, 'KV quality on Gemma 3 270M'): "
                    "int8 +0.60% -> within 0.5% with a 16-token fp16 window, kivi2 +6.50% -> within 5% with 256"),
]


def model_format_options(name: str, options: dict | None, arch: str | None, hidden_size: int | None) -> dict:
    """The options format `name` is built with for a model: its recorded defaults, overridden by `options`."""
    for entry in MODEL_KV_DEFAULTS:
        if entry.arch == arch and entry.hidden_size == hidden_size:
            return {**entry.formats.get(name, {}), **(options or {})}
    return dict(options or {})
