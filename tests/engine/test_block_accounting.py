"""No block leaks: random add / step / abort / preempt workloads (with and without speculative rollback)
keep every block accounted."""
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
    ),
    min_size=1,
    max_size=40,
)


def check_accounting(engine: LLMEngine) -> None:
    kv = engine.kv
    alloc = kv.allocator
    alloc.check()
    assert alloc.num_used + alloc.num_free == alloc.num_blocks
    expected = [0] * alloc.num_blocks
    live = {seq.request_id for seq in list(engine.scheduler.running) + list(engine.scheduler.waiting)}
    assert set(kv.requests) <= live, "KV state kept for a request that is gone"
    for state in kv.requests.values():
        for b in (b for table in state.block_tables for b in table):
            expected[b] += 1
    if kv.prefix_tree is not None:
        for b in (b for node in kv.prefix_tree._postorder() for b in node.block_ids):
            expected[b] += 1
    assert expected == alloc.ref_counts


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(program=ops, prefix_caching=st.booleans(), layout=st.sampled_from(["paged", "contiguous"]),
       speculative=st.booleans())
def test_random_workloads_never_leak(tiny_loaded, program, prefix_caching, layout, speculative):
    # 24 blocks of 4 tokens: small enough that preemption happens often
    cfg = EngineConfig(kv_cache_memory=24 * 4 * 2 * 2 * 2 * 16 * 4, block_size=4, max_model_len=64, max_num_seqs=6,
                       max_num_batched_tokens=24, enable_prefix_caching=prefix_caching, kv_layout=layout,
                       speculative={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
                       if speculative else None)
    engine = LLMEngine(cfg, tiny_loaded)
    assert engine.kv.num_blocks == 24
    run_program(engine, program)


def run_program(engine: LLMEngine, program) -> None:
    """Run an `ops` program, checking the accounting after every operation and step, then drain and reset."""
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
        elif ids:
            engine.abort(ids[op[1] % len(ids)])
        check_accounting(engine)
    while engine.has_unfinished_requests():
        engine.step()
        check_accounting(engine)
    engine.kv.reset_prefix_cache()
    assert engine.kv.allocator.num_free == engine.kv.num_blocks


def test_preemption_happens_and_recovers(tiny_loaded):
    cfg = EngineConfig(kv_cache_memory=24 * 4 * 2 * 2 * 2 * 16 * 4, block_size=4, max_model_len=64,
                       max_num_batched_tokens=64, enable_prefix_caching=False)
    engine = LLMEngine(cfg, tiny_loaded)
    for i in range(6):
        engine.add_request([(i * 13 + j) % 90 for j in range(20)], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
        check_accounting(engine)
    assert engine.scheduler.num_preemptions > 0
    assert len(finished) == 6 and all(len(o.token_ids) == 30 for o in finished)
    assert engine.kv.allocator.num_free == engine.kv.num_blocks
