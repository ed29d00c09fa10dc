"""No block leaks with tiers: random add / step / abort workloads with prefix loads from the host tier, stores on
reclaim, swap-out and swap-in keep every block accounted (nothing leaked, nothing freed twice)."""
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.sampling_params import SamplingParams

ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 60), st.integers(1, 20), st.integers(0, 3)),
        st.tuples(st.just("step"), st.integers(1, 4)),
        st.tuples(st.just("abort"), st.integers(0, 30)),
        st.tuples(st.just("reset"),),
    ),
    min_size=1,
    max_size=40,
)


def check_accounting(engine: LLMEngine) -> None:
    kv, sched = engine.kv, engine.scheduler
    alloc = kv.allocator
    alloc.check()
    expected = [0] * alloc.num_blocks
    live = {s.request_id for s in list(sched.running) + list(sched.waiting) + sched.loading}
    assert set(kv.requests) <= live, "KV state kept for a request that is gone"
    assert set(kv.swapped) <= live, "swapped blocks kept for a request that is gone"
    for state in kv.requests.values():
        for b in [b for table in state.block_tables for b in table] + (state.load.block_ids if state.load else []):
            expected[b] += 1
    if kv.prefix_tree is not None:
        kv.prefix_tree.check()
        for b in (b for node in kv.prefix_tree._postorder() for b in node.block_ids):
            expected[b] += 1
    assert expected == alloc.ref_counts


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(program=ops, prefix_caching=st.booleans(), mode=st.sampled_from(["swap", "recompute"]),
       host=st.sampled_from(["host:4KiB", "host:1MiB"]))
def test_random_workloads_with_tiers_never_leak(tiny_loaded, program, prefix_caching, mode, host):
    cfg = EngineConfig(kv_cache_memory=24 * 4 * 2 * 2 * 2 * 16 * 4, block_size=4, max_model_len=64, max_num_seqs=6,
                       max_num_batched_tokens=24, enable_prefix_caching=prefix_caching, kv_tiers=[host],
                       preemption_mode=mode)
    engine = LLMEngine(cfg, tiny_loaded)
    shared = list(range(5, 25))
    ids = []
    for op in program:
        if op[0] == "add":
            _, plen, max_tokens, family = op
            prompt = (shared * 3)[: plen] if family else [(7 * i + plen) % 90 for i in range(plen)]
            ids.append(engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)))
        elif op[0] == "step":
            for _ in range(op[1]):
                engine.step()
                check_accounting(engine)
        elif op[0] == "reset":
            engine.kv.reset_prefix_cache()
        elif ids:
            engine.abort(ids[op[1] % len(ids)])
        check_accounting(engine)
    while engine.has_unfinished_requests():
        engine.step()
        check_accounting(engine)
    engine.kv.reset_prefix_cache()
    engine.close()
    assert engine.kv.allocator.num_free == engine.kv.num_blocks and not engine.kv.swapped
