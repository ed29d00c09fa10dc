"""Layer-skip self-drafting: the target's own first N layers (or a chosen subset) plus its final norm and LM
head draft the next tokens (Zhang et al. 2023, "Draft & Verify", arXiv:2309.08168; Elhoushi et al. 2024,
"LayerSkip", arXiv:2404.16710).

The drafter reads the target's committed K/V of its layers and writes the lookahead rows of those layers into
the target's own cache, at the slots verification is about to rewrite with the same token at the same
position; it owns no cache at all. A model trained without early-exit loss drafts poorly from a shallow
prefix: measured acceptance is in docs/results.md.
"""
from __future__ import annotations

import inspect

import torch

from kvforge.engine.speculative.model_drafter import ModelDrafter
from kvforge.errors import ConfigError
from kvforge.kv.pool import KVPool


def check_layer_skip(model: torch.nn.Module) -> None:
    if "layers" not in inspect.signature(model.forward).parameters:
        raise ConfigError(f"speculative layer_skip needs a model that can run a subset of its layers; "
                          f"{type(model).__name__} cannot (supported: the llama family)")


class LayerSkipDrafter(ModelDrafter):
    def __init__(self, model: torch.nn.Module, layers: tuple[int, ...], pool: KVPool):
        self.layers = layers
        super().__init__(lambda ids, meta: model(ids, meta, pool, layers=layers), model.compute_logits,
                         len(layers) / len(model.model.layers))

    def stats(self) -> dict:
        return {"spec_draft_layers": list(self.layers)}
