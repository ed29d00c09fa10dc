"""An engine's memory goes when its last reference does: no reference cycle keeps a KV pool alive until the cyclic
garbage collector happens to run (benchmarks and tests build many engines in one process)."""
import gc
import weakref

import pytest

from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.sampling_params import SamplingParams


@pytest.mark.parametrize("options", [{}, {"speculative": {"method": "ngram"}}, {"kv_cache_dtype": "int4", "kv_cache_options": {"group_size": 16}},
                                     {"kv_tiers": ["host:1MiB"]}])
def test_a_dropped_engine_frees_its_pool_without_the_cyclic_collector(tiny_loaded, options):
    engine = LLMEngine(EngineConfig(kv_cache_memory="2MiB", **options), tiny_loaded)
    engine.add_request([5, 6, 7, 8] * 9, SamplingParams(temperature=0, max_tokens=4))
    while engine.has_unfinished_requests():
        engine.step()
    engine.close()
    pool = weakref.ref(engine.kv.pool)
    gc.collect()
    gc.disable()
    try:
        del engine
        assert pool() is None
    finally:
        gc.enable()
