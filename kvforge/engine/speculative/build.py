"""The drafter an engine gets for its `speculative` method (the draft model is loaded before pools are sized)."""
from __future__ import annotations

import torch

from kvforge.engine.speculative.config import SpeculativeConfig
from kvforge.engine.speculative.draft_model import DraftModelDrafter, load_draft
from kvforge.engine.speculative.layer_skip import LayerSkipDrafter
from kvforge.engine.speculative.model_drafter import ModelDrafter
from kvforge.errors import ConfigError
from kvforge.kv.layer_format import KVFormat
from kvforge.kv.manager import KVCacheManager
from kvforge.kv.pool import KVPool
from kvforge.models.loader import LoadedModel


def load_draft_model(config: SpeculativeConfig | None, target: LoadedModel, device: torch.device, max_model_len: int,
                     policy, fmt: KVFormat, block_size: int) -> LoadedModel | None:
    """The draft model of method 'draft' (None for other methods), checked against the target and the cache."""
    if config is None or config.method != "draft":
        return None
    if policy.evicts:
        raise ConfigError(f"speculative method 'draft' cannot run with the evicting kv_policy {policy.name!r}: the "
                          "draft's cache would have to be compacted alike; use 'ngram' or 'layer_skip' there")
    draft = load_draft(config.model, target, device, max_model_len)
    fmt.validate(draft.config.kv_cache_spec(), block_size)
    return draft


def build_drafter(config: SpeculativeConfig, model: torch.nn.Module, kv: KVCacheManager, draft: LoadedModel | None,
                  max_num_seqs: int) -> ModelDrafter | None:
    if config.method == "layer_skip":
        return LayerSkipDrafter(model, config.drafted_layers(len(model.model.layers)), kv.pool)
    if config.method == "draft":
        windows = set(draft.config.layer_windows()) | {g.window for g in kv.groups}
        if len(kv.groups) > 1 or len(windows) > 1:
            raise ConfigError("speculative method 'draft' needs a target whose layers form one KV group and a draft "
                              f"with the same attention window; got target groups {kv.groups} and draft windows "
                              f"{sorted(set(draft.config.layer_windows()), key=str)}")
        pool = KVPool(draft.config.kv_cache_spec(), kv.format, kv.num_blocks, kv.block_size,
                      next(model.parameters()).device, max_num_seqs)
        return DraftModelDrafter(draft.model, pool, _num_parameters(draft.model) / _num_parameters(model))
    return None


def _num_parameters(model: torch.nn.Module) -> int:
    """Weights and buffers (int8 weights are buffers), at least 1."""
    return max(1, sum(t.numel() for t in (*model.parameters(), *model.buffers())))

