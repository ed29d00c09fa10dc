"""The engine's speculation, built in three calls: every check of the options against the target before anything is
allocated, the draft model (method 'draft', loaded before pools are sized) and, once the pool exists, the decoder."""
from __future__ import annotations

import torch

from kvforge.engine.speculative.decoder import SpeculativeDecoder
from kvforge.engine.speculative.draft_model import DraftModelDrafter, load_draft
from kvforge.engine.speculative.layer_skip import LayerSkipDrafter, check_layer_skip
from kvforge.engine.speculative.model_drafter import ModelDrafter
from kvforge.errors import ConfigError
from kvforge.kv.groups import KVGroup
from kvforge.kv.layer_format import KVFormat
from kvforge.kv.manager import KVCacheManager
from kvforge.kv.pool import KVPool
from kvforge.models.loader import LoadedModel
from kvforge.speculative_config import SpeculativeConfig


def check_speculation(config: SpeculativeConfig | None, model: torch.nn.Module, groups: list[KVGroup], policy) -> None:
    """ConfigError when the method cannot run on this target model, its KV groups or the KV policy."""
    if config is None:
        return
    if config.method == "layer_skip":
        check_layer_skip(model)
        config.drafted_layers(len(model.model.layers))
    if config.method == "draft" and policy.evicts:
        raise ConfigError(f"speculative method 'draft' cannot run with the evicting kv_policy {policy.name!r}: the "
                          "draft's cache would have to be compacted alike; use 'ngram' or 'layer_skip' there")
    if config.method == "draft" and len(groups) > 1:
        raise ConfigError(f"speculative method 'draft' needs a target whose layers form one KV group (the draft mirrors "
                          f"its block table); this model has {len(groups)}: {groups}")


def load_draft_model(config: SpeculativeConfig | None, target: LoadedModel, device: torch.device, max_model_len: int,
                     fmt: KVFormat, block_size: int, groups: list[KVGroup]) -> LoadedModel | None:
    """The draft model of method 'draft' (None for other methods), checked against the target and the cache."""
    if config is None or config.method != "draft":
        return None
    draft = load_draft(config.model, target, device, max_model_len)
    fmt.validate(draft.config.kv_cache_spec(), block_size)
    windows = set(draft.config.layer_windows())
    if len(windows | {g.window for g in groups}) > 1:
        raise ConfigError("speculative method 'draft' needs a target whose layers form one KV group and a draft with "
                          f"the same attention window; got target groups {groups} and draft windows "
                          f"{sorted(windows, key=str)}")
    return draft


def build_speculator(config: SpeculativeConfig, runner, draft: LoadedModel | None, max_num_seqs: int,
                     length_limit: int) -> SpeculativeDecoder:
    """The decoder over the runner's model and pool; the planner prices steps with the runner's step cost."""
    drafter = _drafter(config, runner.model, runner.kv, draft, max_num_seqs)
    cost = runner.step_cost(config.verify_row_cost, config.bridge_jump, config.bridge_row_cost)
    return SpeculativeDecoder(config, length_limit, runner.evictor, drafter, cost, runner.kv)


def _drafter(config: SpeculativeConfig, model: torch.nn.Module, kv: KVCacheManager, draft: LoadedModel | None,
             max_num_seqs: int) -> ModelDrafter | None:
    if config.method == "layer_skip":
        return LayerSkipDrafter(model, config.drafted_layers(len(model.model.layers)), kv.pool)
    if config.method == "draft":
        pool = KVPool(draft.config.kv_cache_spec(), kv.format, kv.num_blocks, kv.block_size,
                      next(model.parameters()).device, max_num_seqs)
        pool.share_staging(kv.pool.may_stage, kv.pool.sink_pins)  # the same block ids, the same windows and pins
        kv.staging_pools.append(pool)
        return DraftModelDrafter(draft.model, pool, _num_parameters(draft.model) / _num_parameters(model))
    return None


def _num_parameters(model: torch.nn.Module) -> int:
    """Weights and buffers (int8 weights are buffers), at least 1."""
    return max(1, sum(t.numel() for t in (*model.parameters(), *model.buffers())))
