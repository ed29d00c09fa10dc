"""KV cache groups: models with sliding-window layers match transformers past the window, and a sliding
group holds only the blocks its window needs (the rows the one formula says)."""
import pytest
import torch
from tiny_models import write_tiny_model

from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.engine.scoring import position_logits
from kvforge.errors import ConfigError
from kvforge.kv.groups import NULL_BLOCK, KVGroup, build_groups
from kvforge.kv.memory import blocks_for_sequence, bytes_for_sequence, pool_bytes
from kvforge.models.loader import load_model
from kvforge.sampling_params import SamplingParams

TOKENS = torch.randint(0, 96, (50,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen2-hybrid")
    return write_tiny_model("qwen2-hybrid", d), load_model(str(d))


@pytest.mark.parametrize("kind", ["qwen2-hybrid", "qwen2-window-layers", "mistral"])
def test_logits_past_the_window_match_transformers(kind, tmp_path):
    hf = write_tiny_model(kind, tmp_path)
    loaded = load_model(str(tmp_path))
    assert loaded.config.layer_windows() == [hf.config.sliding_window if t == "sliding_attention" else None
                                             for t in getattr(hf.config, "layer_types", None) or ["sliding_attention"] * 2]
    with torch.no_grad():
        ref = hf(torch.tensor([TOKENS])).logits[0]
    for groups in (True, False):
        engine = LLMEngine(EngineConfig(kv_cache_memory=1 << 22, block_size=4, kv_cache_groups=groups), loaded)
        assert engine.policy.name == "full"
        for chunk in (5, 64):
            torch.testing.assert_close(position_logits(engine, TOKENS, chunk_size=chunk), ref, atol=1e-4, rtol=1e-4)


def test_groups_of_layer_windows():
    assert build_groups([None, 12, None, 12]) == [KVGroup((0, 2), None), KVGroup((1, 3), 12)]
    assert build_groups([None, 12, None, 12], hybrid=False) == [KVGroup((0, 1, 2, 3), None)]
    assert build_groups([8, 8]) == [KVGroup((0, 1), 8)]
    six = build_groups([None if (i + 1) % 6 == 0 else 512 for i in range(18)])  # Gemma 3's pattern
    assert [len(g.layers) for g in six] == [3] * 6 and sum(g.sliding for g in six) == 5
    assert build_groups([None] * 5 + [4] * 3)[:2] == [KVGroup((0, 1, 2), None), KVGroup((3, 4), None)]


def test_sliding_group_holds_its_window_only(hybrid):
    """Decoding 80 tokens (window 12, blocks of 4): after every step the blocks in use are exactly the formula's,
    a sliding table keeps placeholders behind the window, and bytes drop below every-layer-full."""
    _, loaded = hybrid
    engines = {g: LLMEngine(EngineConfig(kv_cache_memory=1 << 22, block_size=4, enable_prefix_caching=False,
                                         kv_cache_groups=g), loaded) for g in (True, False)}
    for groups, engine in engines.items():
        kv = engine.kv
        assert kv.pool.allocated_bytes() == pool_bytes(engine.kv_spec, engine.format, 4, kv.num_blocks, 64, kv.groups)
        rid = engine.add_request(list(range(1, 11)), SamplingParams(temperature=0, max_tokens=70, ignore_eos=True))
        seq = engine.requests[rid]
        while engine.has_unfinished_requests():
            engine.step()
            if seq.is_finished:
                break
            n = seq.num_computed_tokens
            assert kv.allocator.num_used == blocks_for_sequence(n, 4, kv.groups)
            assert kv.allocator.num_used * kv.block_bytes == bytes_for_sequence(engine.kv_spec, engine.format, n, 4, kv.groups)
            if groups:
                sliding = kv.block_table(seq, 1)
                assert sliding.count(NULL_BLOCK) == max(0, n - 1 - 12 + 1) // 4
                assert len(sliding) - sliding.count(NULL_BLOCK) <= 12 // 4 + 1
        assert kv.allocator.num_used == 0
    n = 80
    grouped, full = (bytes_for_sequence(e.kv_spec, e.format, n, 4, e.kv.groups) for e in engines.values())
    # window 12: the query at 79 sees 68..79, blocks 17..19; every block is 2 layer slots (groups) or 4
    assert grouped == (20 + 3) * 2 * 4 * 2 * 2 * 16 * 4 and full == 20 * 4 * 4 * 2 * 2 * 16 * 4


def test_generation_matches_transformers_with_chunks_preemption_prefix_and_speculation(hybrid):
    """Tiny budget (preemption), 5-token steps (chunked prefill), shared prompts (prefix hits past the window),
    n-gram drafts (rollback in both groups)."""
    from kvforge import LLM

    hf, loaded = hybrid
    base = torch.randint(0, 96, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    prompts = [base + [7, 8, 9][:k] for k in range(3)] + [base[:5], (base[:6] * 4)[:22]]
    refs = [hf.generate(torch.tensor([p]), max_new_tokens=16, min_new_tokens=16, do_sample=False)[0, len(p):].tolist()
            for p in prompts]
    for speculative in (None, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}):
        llm = LLM.from_engine(LLMEngine(EngineConfig(
            kv_cache_memory=30 * 2 * 4 * 2 * 2 * 16 * 4, block_size=4, max_num_batched_tokens=5, max_num_seqs=4,
            speculative=speculative), loaded))
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        assert [out.token_ids for out in outs] == refs
        stats = llm.engine.stats()
        assert stats["prefix_hit_tokens"] > 12 and stats["preemptions"] > 0
        assert stats["kv_blocks_used"] == stats["kv_blocks_cached_idle"]


def test_evicting_policies_need_a_full_attention_group(tmp_path, hybrid):
    write_tiny_model("mistral", tmp_path)
    with pytest.raises(ConfigError, match="every layer"):
        LLMEngine(EngineConfig(kv_cache_memory=1 << 22, kv_policy="window", kv_policy_options={"budget": 8}),
                  load_model(str(tmp_path)))
    with pytest.raises(ConfigError, match="cache index"):
        LLMEngine(EngineConfig(kv_cache_memory=1 << 22, kv_policy="streaming", kv_policy_options={"budget": 8}),
                  hybrid[1])


def test_policies_compact_full_attention_groups_only(hybrid):
    """h2o on a hybrid model: the full groups' tables are compacted to the budget, the sliding group keeps
    its window, and everything is freed at the end."""
    engine = LLMEngine(EngineConfig(kv_cache_memory=1 << 22, block_size=4, kv_policy="h2o",
                                    kv_policy_options={"budget": 16, "slack": 4}), hybrid[1])
    rid = engine.add_request(list(range(1, 31)), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    seq, kv = engine.requests[rid], engine.kv
    while not seq.is_finished:
        engine.step()
        if not seq.is_finished:
            assert kv.cache_len(seq) <= 16 + 4 and kv.group_cache_len(seq, 1) == seq.num_computed_tokens
            assert len(kv.block_table(seq, 0)) == -(-kv.cache_len(seq) // 4)
    assert engine.runner.evictor.evicted_tokens > 0 and kv.allocator.num_used == 0


def test_prefix_caching_does_not_pin_blocks_behind_the_window(hybrid):
    """With prefix caching on, a long sequence's sliding blocks behind the window stay cached only until
    memory is needed: a second sequence fits beside it (reclaimed), and a request sharing its prompt still
    hits (the window before the hit point is kept while the first one runs)."""
    _, loaded = hybrid
    engine = LLMEngine(EngineConfig(kv_cache_memory=40 * 2 * 4 * 2 * 2 * 16 * 4, block_size=4, max_model_len=100,
                                    max_num_batched_tokens=8), loaded)
    prompt = list(range(1, 41))
    first = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    while engine.requests[first].num_computed_tokens < 60:
        engine.step()
    # 60 tokens: 15 full blocks + 3..4 window blocks held; the tree keeps the 10 behind-window prompt blocks
    assert engine.kv.stats()["kv_blocks_cached_idle"] >= 10
    second = engine.add_request(prompt + [50, 51], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    engine.step()
    assert engine.requests[second].num_computed_tokens >= 40  # hit at 40: full blocks + the window before it
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.scheduler.num_preemptions == 0 and engine.kv.stats()["prefix_hit_tokens"] == 40


@pytest.mark.parametrize("fmt", ["fp16", "int8", "int4", "kivi2"])
def test_every_format_works_per_group(hybrid, fmt):
    """A format stores each group's blocks alike: groups give the logits of every-layer-full storage (the
    window masks them the same), and the pool allocates what the formula says (staging per group)."""
    _, loaded = hybrid
    logits = []
    for groups in (True, False):
        options = {"group_size": 16} if fmt in ("int4", "kivi2") else None  # the tiny model's head_dim is 16
        engine = LLMEngine(EngineConfig(kv_cache_memory=1 << 22, block_size=8, kv_cache_dtype=fmt, max_num_seqs=2,
                                        kv_cache_options=options, kv_cache_groups=groups), loaded)  # 8 > 4 sinks
        kv = engine.kv
        assert kv.pool.allocated_bytes() == pool_bytes(engine.kv_spec, engine.format, 8, kv.num_blocks, 2, kv.groups)
        logits.append(position_logits(engine, TOKENS, chunk_size=8))
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=1e-5)


def test_hybrid_memory_bench_fits_more_sequences(hybrid):
    """Budget of two 64-token sequences with every layer full (2 x 16 blocks of 4 layer slots = 64 blocks of 2):
    with groups one sequence holds 16 full + 4 window blocks (12 + 4 tokens), so 64 // 20 = 3 fit. Sequences
    decoding at once show it (3 vs 2); sequences running do not: each side also admits a third or fourth for its
    first chunk and preempts it."""
    from kvforge.bench.hybrid import hybrid_bench

    r = hybrid_bench(hybrid[1], seq_len=64, num_requests=6, budget_seqs=2, output_len=8, block_size=4, chunk=32,
                     show_progress=False)
    assert (r["groups"]["sequences_that_fit"], r["full_layers"]["sequences_that_fit"]) == (3, 2)
    assert r["groups"]["num_blocks"] == 64 and r["full_layers"]["num_blocks"] == 32
    assert (r["groups"]["peak_decoding_seqs"], r["full_layers"]["peak_decoding_seqs"]) == (3, 2)
    assert r["full_layers"]["peak_concurrent_seqs"] > 2
    assert r["concurrency_ratio"] == 1.5


def test_reset_leaves_no_tree_node_in_any_group(hybrid):
    """Repeated workloads, each followed by a reset: every group's tree, sliding ones included, ends empty
    (nodes whose blocks were reclaimed behind the window are dropped, not kept as empty husks)."""
    _, loaded = hybrid
    engine = LLMEngine(EngineConfig(kv_cache_memory=40 * 2 * 4 * 2 * 2 * 16 * 4, block_size=4, max_model_len=100,
                                    max_num_batched_tokens=16, max_num_seqs=4), loaded)
    for round_ in range(3):
        for i in range(4):
            prompt = [(round_ * 31 + i * 7 + j) % 90 + 1 for j in range(30 + 3 * i)]
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        engine.kv.reset_prefix_cache()
        assert [tree.num_nodes() for tree in engine.kv.prefix_trees] == [0, 0]
        assert engine.kv.allocator.num_free == engine.kv.num_blocks
