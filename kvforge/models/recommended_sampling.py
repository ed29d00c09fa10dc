"""The sampling a model's authors recommend: generation_config.json, GGUF metadata, or kvforge's per-model table.

vLLM applies a Hugging Face directory's generation_config.json unless told otherwise; llama.cpp writes the same
fields into GGUF metadata (`general.sampling.*`); GGUFs that carry none get the packaged-model registry's entry
(the model card's advice). Only SamplingParams fields are taken; what a request sets itself wins.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from kvforge.models.packaged import card_sampling

_HF_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
              "repetition_penalty": "repetition_penalty"}
_GGUF_FIELDS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
                "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
                "general.sampling.penalty_repeat": "repetition_penalty"}


@dataclass(frozen=True)
class RecommendedSampling:
    values: dict = field(default_factory=dict)  # SamplingParams field -> value
    source: str = ""  # where the values come from, for --help, start-up lines and /v1/models

    def __bool__(self) -> bool:
        return bool(self.values)

    def describe(self) -> str:
        shown = ", ".join(f"{k} {v:g}" for k, v in self.values.items())
        return f"{shown} ({self.source})"


def recommended_sampling(path: str) -> RecommendedSampling:
    """The model's recommended sampling; empty (falsy) when it recommends none."""
    if os.path.isdir(path):
        return _from_generation_config(path)
    if os.path.isfile(path):
        return _from_gguf(path)
    return RecommendedSampling()


def _from_generation_config(directory: str) -> RecommendedSampling:
    file = os.path.join(directory, "generation_config.json")
    try:
        with open(file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return RecommendedSampling()
    values = _clean({ours: config.get(theirs) for theirs, ours in _HF_FIELDS.items()} if isinstance(config, dict) else {})
    return RecommendedSampling(values, "the model's generation_config.json") if values else RecommendedSampling()


def _from_gguf(path: str) -> RecommendedSampling:
    from kvforge.models.gguf_header import open_gguf, read_gguf_header

    try:
        meta, _ = read_gguf_header(path, open_gguf(path))
    except Exception:  # noqa: BLE001 - the loader reports a broken file with its own message
        return RecommendedSampling()
    values = _clean({ours: meta.get(key) for key, ours in _GGUF_FIELDS.items()})
    if values:
        return RecommendedSampling(values, "the GGUF's general.sampling metadata")
    card = card_sampling(meta)
    return RecommendedSampling(dict(card[0]), card[1]) if card else RecommendedSampling()


def _clean(values: dict) -> dict:
    """Numbers only; top_k 0 (Hugging Face's 'off') becomes SamplingParams' -1."""
    kept = {k: v for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    if kept.get("top_k") is not None:
        kept["top_k"] = int(kept["top_k"]) if kept["top_k"] > 0 else -1
    return kept
