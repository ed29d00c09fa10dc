"""The KV connector is the manager's one seam for moving KV: a connector other than the tiers' plugs in unchanged,
and the tiers' rule of one KV group is refused before any pool is allocated."""
from __future__ import annotations

from concurrent.futures import Future

import pytest

from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.errors import ConfigError
from kvforge.kv.connector import KVConnector, Transfer
from kvforge.kv.manager import KVCacheManager
from kvforge.sampling_params import SamplingParams

BS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PROMPT = [(i * 7 + (i * i) % 11) % 90 + 3 for i in range(37)]


class DictConnector(KVConnector):
    """Blocks kept in a dict by their token prefix, stored when cached (write-through), loaded at admission."""

    def __init__(self, store: dict, pool):
        self.store, self.block_io = store, pool
        self.cached_calls = 0

    def _keys(self, tokens, salt):
        return [(salt, tuple(tokens[:(i + 1) * BS])) for i in range(len(tokens) // BS)]

    def start_load(self, tokens, salt, matched):
        run = []
        for key in self._keys(tokens, salt)[matched // BS:]:
            if key not in self.store:
                break
            run.append(self.store[key])
        if not run:
            return None
        fetched = Future()
        fetched.set_result(run)
        return Transfer(fetched, [], matched)

    def finish_load(self, block_ids, payloads):
        self.block_io.import_blocks(block_ids, payloads)

    def on_cached(self, tokens, salt, block_ids, cached_tokens):
        self.cached_calls += 1
        new = self._keys(tokens, salt)[cached_tokens // BS:len(block_ids)]
        self.store.update(zip(new, self.block_io.export_blocks(block_ids[cached_tokens // BS:])))


def _engine(loaded) -> LLMEngine:
    return LLMEngine(EngineConfig(block_size=BS, max_model_len=64, max_num_batched_tokens=64,
                                  kv_cache_memory=1 << 22), loaded)


def _generate(e: LLMEngine) -> list[int]:
    rid = e.add_request(PROMPT, GREEDY)
    out = None
    while e.has_unfinished_requests():
        out = next((o for o in e.step() if o.request_id == rid and o.finished), out)
    return out.token_ids


def test_a_connector_of_its_own_serves_a_second_engine(tiny_loaded):
    store: dict = {}
    first = _engine(tiny_loaded)
    first.kv.attach_connector(DictConnector(store, first.kv.pool))
    expected = _generate(first)
    assert len(store) == (len(PROMPT) + GREEDY.max_tokens - 1) // BS  # every full block, stored once

    second = _engine(tiny_loaded)
    second.kv.attach_connector(DictConnector(store, second.kv.pool))
    assert _generate(second) == expected
    s = second.stats()
    assert s["prefix_hit_tokens"] == (len(PROMPT) - 1) // BS * BS  # the whole usable prompt came from the store
    assert second.kv.allocator.num_free == second.kv.num_blocks - s["kv_blocks_cached_idle"]
    assert second.tiers is None and not second.kv.swapped  # tiers are one connector; this engine has none


def test_manager_is_not_a_mixin_of_tier_hooks():
    assert not [c for c in KVCacheManager.__mro__ if c.__module__.startswith("kvforge.kv.tiers")]


def test_tiers_on_two_kv_groups_are_refused_before_the_pool_is_allocated(tmp_path, monkeypatch):
    from tiny_models import write_tiny_model

    from kvforge.models.loader import load_model

    write_tiny_model("qwen2-hybrid", tmp_path)
    loaded = load_model(str(tmp_path))

    def no_pool(*args, **kwargs):
        raise AssertionError("a KV pool was allocated before the tier check")

    monkeypatch.setattr("kvforge.kv.manager.KVPool", no_pool)
    with pytest.raises(ConfigError, match="one KV group"):
        LLMEngine(EngineConfig(kv_tiers=["host:1MiB"], max_model_len=64, kv_cache_memory=1 << 22), loaded)
