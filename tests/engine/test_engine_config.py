"""EngineConfig holds parsed options (speculation as a SpeculativeConfig, preemption rules in one place), and the engine
refuses options its model cannot run before it allocates a KV pool."""
import dataclasses

import pytest

from kvforge.config import EngineConfig
from kvforge.engine import engine as engine_module
from kvforge.engine.engine import LLMEngine
from kvforge.errors import ConfigError
from kvforge.speculative_config import SpeculativeConfig


def test_speculative_options_are_parsed_once_into_a_speculative_config():
    config = EngineConfig(speculative={"method": "ngram", "num_speculative_tokens": 3})
    assert config.speculative == SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    assert EngineConfig(speculative=config.speculative).speculative is config.speculative
    assert dataclasses.replace(config, seed=1).speculative == config.speculative
    assert EngineConfig().speculative is None


def test_preemption_rules_live_in_the_config():
    with pytest.raises(ConfigError, match="needs a KV tier"):
        EngineConfig(preemption_mode="swap")
    host, disk = EngineConfig(kv_tiers=["host:1MiB"]), EngineConfig(kv_tiers=["disk:/tmp/x:1MiB"])
    assert [host.resolve_preemption_mode(evicts) for evicts in (True, False)] == ["swap", "recompute"]
    assert disk.resolve_preemption_mode(True) == "recompute"
    assert EngineConfig(kv_tiers=["host:1MiB"], preemption_mode="recompute").resolve_preemption_mode(True) == "recompute"


class Allocated(Exception):
    pass


@pytest.mark.parametrize("speculative,match", [
    ({"method": "layer_skip", "num_layers": 2}, "proper subset"),
    ({"method": "draft", "model": "/nonexistent/draft.gguf"}, "one KV group"),
], ids=["layer_skip-layers", "draft-on-kv-groups"])
def test_speculation_the_model_cannot_run_is_refused_before_any_allocation(tiny_loaded, tmp_path, monkeypatch,
                                                                            speculative, match):
    from tiny_models import write_tiny_model

    from kvforge.models.loader import load_model

    loaded = tiny_loaded
    if speculative["method"] == "draft":  # a target of two KV groups (full and sliding-window layers)
        write_tiny_model("qwen2-hybrid", tmp_path)
        loaded = load_model(str(tmp_path))

    def allocate(*args, **kwargs):
        raise Allocated("the KV pool was allocated before the options were checked")

    monkeypatch.setattr(engine_module, "KVCacheManager", allocate)
    monkeypatch.setattr(engine_module, "prepare_bridge", allocate)
    with pytest.raises(ConfigError, match=match):
        LLMEngine(EngineConfig(kv_cache_memory=1 << 22, speculative=speculative), loaded)
