"""Combinations of options the engine does not run, refused with a ConfigError before anything is allocated."""
from __future__ import annotations

from kvforge.config import EngineConfig
from kvforge.errors import ConfigError
from kvforge.kv.groups import StateGroup


def check_combinations(config: EngineConfig, policy, state_groups: list[StateGroup]) -> None:
    spec = config.speculative
    if policy.reconstructs and spec and spec.method != "ngram":
        raise ConfigError(f"kv_policy {policy.name!r} with speculative method {spec.method!r}: "
                          "its drafter would mirror the scoring pass into its own cache; use 'ngram'")
    if policy.evicts and config.kv_layout != "paged":
        raise ConfigError(f"kv_policy {policy.name!r} evicts tokens and needs kv_layout='paged'")
    if not state_groups:
        return
    kinds = ", ".join(sorted({g.kind for g in state_groups}))
    if policy.reconstructs:
        raise ConfigError(f"kv_policy {policy.name!r} is not supported on a model with recurrent layers ({kinds}): "
                          "its scoring pass would run over their state; use another policy")
    if spec and spec.method != "ngram":
        raise ConfigError(f"speculative method {spec.method!r} is not supported on a model with "
                          f"recurrent layers ({kinds}): its drafter would run the target's layers over their state; "
                          "use 'ngram'")


def check_compressed_reuse(policy, groups, stage_blocks: int, kv_cache_dtype: str) -> None:
    """Compressed prompts are shared as whole blocks of full-attention layers read as stored: refuse sliding-window
    layers (their blocks follow the window, not the compressed rows) and formats that keep fp16 windows."""
    if any(g.sliding for g in groups):
        raise ConfigError(f"kv_policy {policy.name!r} with reuse: this model has sliding-window layers, whose blocks "
                          "cannot be shared compressed; leave reuse off")
    if stage_blocks:
        raise ConfigError(f"kv_policy {policy.name!r} with reuse: kv_cache_dtype {kv_cache_dtype!r} keeps fp16 windows "
                          "of recent blocks, which are not shared yet; use a format without them (fp32, fp16, bf16, int8, "
                          "fp8_e4m3, fp8_e5m2) or leave reuse off")
