"""Model drafters (layer_skip, draft): lossless greedy output, all-accepting self-draft, block accounting
with draft KV, refused mismatched tokenizers."""
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_block_accounting import ops, run_program
from test_speculative import FORMATS, PROMPTS, make, run

from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.errors import ConfigError, TokenizerMismatchError
from kvforge.kv.memory import bytes_per_block, side_bytes
from kvforge.models.loader import load_model
from kvforge.sampling_params import SamplingParams

SKIP = {"method": "layer_skip", "num_speculative_tokens": 4, "num_layers": 1}


@pytest.fixture(scope="module")
def other_draft_dir(tmp_path_factory):
    """A different random model with the same (absent) tokenizer and vocabulary."""
    from tiny_models import write_tiny_model

    d = tmp_path_factory.mktemp("tiny-draft-mqa")
    write_tiny_model("llama-mqa", d, seed=3)
    return str(d)


def draft_spec(path):
    return {"method": "draft", "model": path, "num_speculative_tokens": 4}


@pytest.mark.parametrize("fmt,opts", FORMATS, ids=[f for f, _ in FORMATS])
def test_layer_skip_greedy_output_is_identical(tiny_loaded, fmt, opts):
    kw = {"kv_cache_dtype": fmt, "kv_cache_options": opts}
    off = run(make(tiny_loaded, None, **kw))
    on_engine = make(tiny_loaded, SKIP, **kw)
    assert [o.token_ids for o in run(on_engine)] == [o.token_ids for o in off]
    s = on_engine.stats()
    assert s["spec_num_draft_tokens"] > s["spec_num_accepted_tokens"] > 0
    assert s["spec_draft_layers"] == [0]


@pytest.mark.parametrize("case", ["subset", "preemption", "streaming", "h2o", "sampled"])
def test_layer_skip_under_composition(tiny_loaded, case):
    spec = {**SKIP, "num_layers": None, "layers": [1]} if case == "subset" else SKIP
    kw = {"subset": {}, "sampled": {},
          "preemption": {"blocks": 12, "max_model_len": 80, "max_num_batched_tokens": 16},
          "streaming": {"kv_policy": "streaming", "kv_policy_options": {"budget": 24, "sinks": 4, "slack": 4}},
          "h2o": {"kv_policy": "h2o", "kv_policy_options": {"budget": 24, "slack": 4}}}[case]
    params = SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True, seed=5) if case == "sampled" else None
    off = run(make(tiny_loaded, None, **kw), params)
    on_engine = make(tiny_loaded, spec, **kw)
    on = run(on_engine, params)
    if case != "sampled":  # sampling consumes the generator differently with drafts: same law, other draws
        assert [o.token_ids for o in on] == [o.token_ids for o in off]
    if case == "preemption":
        assert on_engine.scheduler.num_preemptions > 0
    assert on_engine.stats()["spec_num_draft_tokens"] > 0


def test_draft_equal_to_target_accepts_everything(tiny_loaded, tiny_dir):
    off = run(make(tiny_loaded, None))
    on_engine = make(tiny_loaded, draft_spec(tiny_dir))
    assert [o.token_ids for o in run(on_engine)] == [o.token_ids for o in off]
    s = on_engine.stats()
    assert s["spec_num_draft_tokens"] > 0
    assert s["spec_num_accepted_tokens"] == s["spec_num_draft_tokens"]
    assert s["spec_acceptance_rate"] == 1.0


@pytest.mark.parametrize("fmt,opts", FORMATS, ids=[f for f, _ in FORMATS])
def test_other_draft_model_greedy_output_is_identical(tiny_loaded, other_draft_dir, fmt, opts):
    kw = {"kv_cache_dtype": fmt, "kv_cache_options": opts}
    off = run(make(tiny_loaded, None, **kw))
    on_engine = make(tiny_loaded, draft_spec(other_draft_dir), **kw)
    assert [o.token_ids for o in run(on_engine)] == [o.token_ids for o in off]
    s = on_engine.stats()
    assert s["spec_num_draft_tokens"] > s["spec_num_accepted_tokens"]  # a different model: some drafts rolled back


def test_draft_kv_shares_the_one_budget(tiny_loaded, other_draft_dir):
    budget = 1 << 20
    e = make(tiny_loaded, draft_spec(other_draft_dir), kv_cache_memory=budget, kv_cache_dtype="int4",
             kv_cache_options={"group_size": 16})
    pool, draft_pool = e.kv.pool, e.runner.speculator.drafter.pool
    target_spec, d_spec, bs, n = e.kv_spec, e.draft.config.kv_cache_spec(), 8, e.kv.num_blocks
    per_block = bytes_per_block(target_spec, e.format, bs) + bytes_per_block(d_spec, e.format, bs)
    seqs = e.max_num_seqs  # the sequences both pools stage for: max_num_seqs, fewer where the budget runs fewer
    sides = side_bytes(target_spec, e.format, bs, seqs) + side_bytes(d_spec, e.format, bs, seqs)
    assert draft_pool.num_blocks == n
    assert pool.allocated_bytes() + draft_pool.allocated_bytes() == n * per_block + sides <= budget
    assert budget - (n * per_block + sides) < per_block  # one more block would not fit
    assert e.stats()["spec_draft_kv_bytes"] == draft_pool.allocated_bytes()


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(program=ops, prefix_caching=st.booleans(), method=st.sampled_from(["layer_skip", "draft"]))
def test_model_drafters_never_leak_blocks(tiny_loaded, tiny_dir, program, prefix_caching, method):
    spec = {"method": method, "num_speculative_tokens": 3,
            **({"num_layers": 1} if method == "layer_skip" else {"model": tiny_dir})}
    probe = LLMEngine(EngineConfig(block_size=4, max_model_len=64, kv_cache_memory=1 << 20, speculative=spec), tiny_loaded)
    per_block = probe.kv.pool.allocated_bytes() // probe.kv.num_blocks
    if method == "draft":
        per_block += probe.runner.speculator.drafter.pool.allocated_bytes() // probe.kv.num_blocks
    cfg = EngineConfig(kv_cache_memory=24 * per_block, block_size=4, max_model_len=64, max_num_seqs=6,
                       max_num_batched_tokens=24, enable_prefix_caching=prefix_caching, speculative=spec)
    engine = LLMEngine(cfg, tiny_loaded)
    assert engine.kv.num_blocks == 24
    run_program(engine, program)


def _with_tokenizer(src: str, dst, words: list[str]) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    shutil.copytree(src, dst)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(dst / "tokenizer.json"))
    return str(dst)


def test_mismatched_tokenizer_is_refused(tiny_dir, other_draft_dir, tmp_path):
    words = ["<unk>"] + [f"w{i}" for i in range(95)]
    target = load_model(_with_tokenizer(tiny_dir, tmp_path / "target", words))
    same = _with_tokenizer(other_draft_dir, tmp_path / "same", words)
    other = _with_tokenizer(other_draft_dir, tmp_path / "other", words[:50] + ["x"] + words[51:])
    LLMEngine(EngineConfig(kv_cache_memory=1 << 20, max_model_len=64, speculative=draft_spec(same)), target)
    with pytest.raises(TokenizerMismatchError, match="token 50 is 'x' in the draft and 'w49' in the target"):
        LLMEngine(EngineConfig(kv_cache_memory=1 << 20, max_model_len=64, speculative=draft_spec(other)), target)
    with pytest.raises(TokenizerMismatchError, match="one has a tokenizer and the other not"):
        LLMEngine(EngineConfig(kv_cache_memory=1 << 20, max_model_len=64, speculative=draft_spec(other_draft_dir)),
                  target)


@pytest.mark.parametrize("spec, match", [
    ({"method": "layer_skip"}, "exactly one of num_layers"),
    ({"method": "layer_skip", "num_layers": 1, "layers": [0]}, "exactly one of num_layers"),
    ({"method": "layer_skip", "layers": [2, 1]}, "ascending"),
    ({"method": "ngram", "num_layers": 2}, "belong to method 'layer_skip'"),
    ({"method": "draft"}, "needs model"),
    ({"method": "layer_skip", "num_layers": 1, "model": "x"}, "belongs to method 'draft'"),
])
def test_bad_model_drafter_options(spec, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig(speculative=spec)


def test_layer_skip_needs_a_proper_subset_and_draft_refuses_eviction(tiny_loaded, tiny_dir):
    with pytest.raises(ConfigError, match="proper subset"):
        make(tiny_loaded, {**SKIP, "num_layers": 2})
    with pytest.raises(ConfigError, match="evicting kv_policy 'h2o'"):
        make(tiny_loaded, draft_spec(tiny_dir), kv_policy="h2o", kv_policy_options={"budget": 24, "slack": 4})


def test_layer_skip_over_kv_groups(tmp_path):
    """A hybrid model (full and sliding-window groups): the drafter's one-row steps use each group's view."""
    from tiny_models import write_tiny_model

    write_tiny_model("qwen2-hybrid", tmp_path)
    loaded = load_model(str(tmp_path))
    kw = {"blocks": None, "max_num_batched_tokens": 16, "enable_prefix_caching": False}
    prompts = [p * 2 for p in PROMPTS]  # past the 12-token window
    off = run(make(loaded, None, **kw), prompts=prompts)
    on_engine = make(loaded, {**SKIP, "num_layers": 2}, **kw)
    assert len(on_engine.kv.groups) == 2
    assert [o.token_ids for o in run(on_engine, prompts=prompts)] == [o.token_ids for o in off]
    assert on_engine.stats()["spec_num_accepted_tokens"] > 0
    with pytest.raises(ConfigError, match="one KV group"):
        make(loaded, draft_spec(str(tmp_path)))
