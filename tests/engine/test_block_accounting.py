"""No block leaks: random add / step / abort / preempt workloads (with and without speculative rollback)
keep every block accounted, and every recurrent state slot, and a reset leaves no node in any group's prefix tree."""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.kv.groups import NULL_BLOCK
from kvforge.sampling_params import SamplingParams

OPS = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 60), st.integers(1, 20), st.integers(0, 3)),
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.just("abort"), st.integers(0, 30)),
)
ops = st.lists(OPS, min_size=1, max_size=40)


def check_accounting(engine: LLMEngine) -> None:
    kv = engine.kv
    alloc = kv.allocator
    alloc.check()
    assert alloc.num_used + alloc.num_free == alloc.num_blocks
    expected = [0] * alloc.num_blocks
    sched = engine.scheduler
    live = {seq.request_id for seq in list(sched.running) + list(sched.waiting) + sched.loading}
    assert set(kv.requests) <= live, "KV state kept for a request that is gone"
    assert set(kv.swapped) <= live, "swapped blocks kept for a request that is gone"
    for state in kv.requests.values():
        loading = state.load.block_ids if state.load else []  # blocks reserved for a tier load in flight
        for b in [b for table in state.block_tables for b in table if b != NULL_BLOCK] + loading:
            expected[b] += 1
    for tree in kv.prefix_trees:
        tree.check()
        for b in (b for node in tree._postorder() for b in node.block_ids if b != NULL_BLOCK):
            expected[b] += 1
    assert expected == alloc.ref_counts
    seqs = {s.request_id: s for s in engine.scheduler.running}
    if kv.state_pool is not None:  # one state slot per request that holds KV state, none shared, none lost
        slots = [state.state_slot for state in kv.requests.values() if state.state_slot is not None]
        assert len(slots) == len(set(slots)) == kv.state_pool.num_used
        assert kv.state_pool.num_used + kv.state_pool.num_free == kv.state_pool.num_slots
        assert all(kv.requests[seq.request_id].state_slot is not None for seq in sched.running)
    for rid, state in kv.requests.items():
        for group, table in zip(kv.groups, state.block_tables):
            placeholders = table.count(NULL_BLOCK)
            assert NULL_BLOCK not in table[placeholders:], "a placeholder after a live block"
            if rid in seqs:  # blocks behind the window were freed at the step's start
                assert placeholders <= group.first_needed_block(seqs[rid].num_computed_tokens, kv.block_size)


@pytest.fixture(scope="module")
def hybrid_loaded(tmp_path_factory):
    """Two KV groups: full-attention layers 0, 2 and sliding-window (12 tokens) layers 1, 3."""
    from tiny_models import write_tiny_model

    from kvforge.models.loader import load_model

    d = tmp_path_factory.mktemp("qwen2-hybrid")
    write_tiny_model("qwen2-hybrid", d)
    return load_model(str(d))


def accounting_engine(loaded, num_blocks, prefix_caching, layout, speculative) -> LLMEngine:
    # blocks of 4 tokens, each 2 layer slots (llama-gqa: 2 layers; hybrid: groups of 2): preemption happens often
    cfg = EngineConfig(kv_cache_memory=num_blocks * 4 * 2 * 2 * 2 * 16 * 4, block_size=4, max_model_len=64,
                       max_num_seqs=6, max_num_batched_tokens=24, enable_prefix_caching=prefix_caching,
                       kv_layout=layout, speculative={"method": "ngram", "num_speculative_tokens": 3,
                                                      "prompt_lookup_min": 1} if speculative else None)
    engine = LLMEngine(cfg, loaded)
    assert engine.kv.num_blocks == num_blocks
    return engine


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
        elif op[0] == "reset":
            engine.kv.reset_prefix_cache()
        elif ids:
            engine.abort(ids[op[1] % len(ids)])
        check_accounting(engine)
    while engine.has_unfinished_requests():
        engine.step()
        check_accounting(engine)
    engine.kv.reset_prefix_cache()
    assert engine.kv.allocator.num_free == engine.kv.num_blocks
    assert [tree.num_nodes() for tree in engine.kv.prefix_trees] == [0] * len(engine.kv.prefix_trees)
    if engine.kv.state_pool is not None:
        assert engine.kv.state_pool.num_free == engine.kv.state_pool.num_slots


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(program=ops, prefix_caching=st.booleans(), layout=st.sampled_from(["paged", "contiguous"]),
       speculative=st.booleans())
def test_random_workloads_never_leak(tiny_loaded, program, prefix_caching, layout, speculative):
    run_program(accounting_engine(tiny_loaded, 24, prefix_caching, layout, speculative), program)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(program=ops, prefix_caching=st.booleans(), speculative=st.booleans())
def test_random_workloads_never_leak_with_two_kv_groups(hybrid_loaded, program, prefix_caching, speculative):
    """Full and sliding-window groups share the allocator; sliding tables free blocks behind the window."""
    run_program(accounting_engine(hybrid_loaded, 36, prefix_caching, "paged", speculative), program)


@pytest.fixture(scope="module")
def recurrent_loaded(tmp_path_factory):
    """Granite 4.0-H shaped: three Mamba-2 mixer layers (a state slot each sequence) and one attention layer."""
    from tiny_models import write_tiny_model

    from kvforge.models.loader import load_model

    d = tmp_path_factory.mktemp("granite-hybrid")
    write_tiny_model("granite-hybrid", d)
    return load_model(str(d))


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(program=ops, prefix_caching=st.booleans(), layout=st.sampled_from(["paged", "contiguous"]))
def test_random_workloads_never_leak_state_slots(recurrent_loaded, program, prefix_caching, layout):
    """Preemption (24 blocks of 4 tokens for up to 6 sequences of 64), aborts mid-prefill, finishes and resumes from
    state checkpoints (3 of them, evicted LRU) give every state slot back."""
    probe = LLMEngine(EngineConfig(kv_cache_memory=1 << 22, block_size=4, max_num_seqs=6), recurrent_loaded)
    checkpoints = 3 * probe.state_bytes if prefix_caching and layout == "paged" else 0  # room for 3 checkpoints
    cfg = EngineConfig(kv_cache_memory=checkpoints + 6 * probe.state_bytes + 24 * probe.kv.block_bytes, block_size=4,
                       max_model_len=64, max_num_seqs=6, max_num_batched_tokens=24,
                       enable_prefix_caching=prefix_caching, kv_layout=layout, state_checkpoint_memory=checkpoints)
    engine = LLMEngine(cfg, recurrent_loaded)
    assert engine.kv.num_blocks == 24 and engine.kv.state_pool.num_slots == 6
    run_program(engine, program)


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
