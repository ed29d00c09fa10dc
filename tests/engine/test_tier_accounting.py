"""No block leaks with tiers: random add / step / abort workloads with prefix loads from the host tier, stores on
reclaim, swap-out and swap-in keep every block accounted (nothing leaked, nothing freed twice)."""
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_block_accounting import OPS, run_program

from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine

ops = st.lists(st.one_of(OPS, st.tuples(st.just("reset"),)), min_size=1, max_size=40)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(program=ops, prefix_caching=st.booleans(), mode=st.sampled_from(["swap", "recompute"]),
       host=st.sampled_from(["host:4KiB", "host:1MiB"]))
def test_random_workloads_with_tiers_never_leak(tiny_loaded, program, prefix_caching, mode, host):
    cfg = EngineConfig(kv_cache_memory=24 * 4 * 2 * 2 * 2 * 16 * 4, block_size=4, max_model_len=64, max_num_seqs=6,
                       max_num_batched_tokens=24, enable_prefix_caching=prefix_caching, kv_tiers=[host],
                       preemption_mode=mode)
    engine = LLMEngine(cfg, tiny_loaded)
    run_program(engine, program)
    engine.close()
    assert engine.kv.allocator.num_free == engine.kv.num_blocks and not engine.kv.swapped
