"""KV formats and evicting policies on a hybrid's attention layers (tiny Granite 4.0-H: Mamba-2 mixers and two
attention layers): every format runs with prefix caching and a disk tier, and every evicting policy keeps as many
blocks per decoding sequence as on an all-attention model; nothing leaks (blocks, state slots, request states), also
after an abort mid-decode. The lossless cases equal plain decoding: fp32 KV; the plain-dtype and per-token
(non-staged) formats with prefix caching and tiers on or off; a policy whose budget is above the length."""
from __future__ import annotations

import pytest
import torch
from tiny_models import write_tiny_model

from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.errors import ConfigError
from kvforge.kv.memory import blocks_for_tokens
from kvforge.models.loader import load_model
from kvforge.sampling_params import SamplingParams

PROMPT = torch.randint(0, 96, (100,), generator=torch.Generator().manual_seed(7)).tolist()
OTHER = torch.randint(0, 96, (30,), generator=torch.Generator().manual_seed(8)).tolist()
PROMPTS = [PROMPT[:70], PROMPT[:70], PROMPT[:40] + OTHER, PROMPT]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
SLACK = 16  # a sequence's cache is compacted when it passes budget + slack (kvforge.kv.policies)
# formats whose rows a prefix hit reads as the request would have written them (staged ones, int4 and kivi2, keep
# a request's own last rows fp16 while adopted blocks read as codes, on attention models too)
UNSTAGED = [("fp32", None), ("fp16", None), ("bf16", None), ("fp8_e4m3", None), ("int8", None)]
STAGED = [("int4", {"group_size": 16}), ("kivi2", {"group_size": 16})]
POLICIES = ["streaming", "h2o", "snapkv", "keydiff", "expected_attention", "tova"]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    d = tmp_path_factory.mktemp("granite-hybrid")
    write_tiny_model("granite-hybrid", d)
    return load_model(str(d))


@pytest.fixture(scope="module")
def attention(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama-gqa")
    write_tiny_model("llama-gqa", d)
    return load_model(str(d))


def _engine(loaded, **options) -> LLMEngine:
    return LLMEngine(EngineConfig(kv_cache_memory=4 << 20, max_num_seqs=4, max_num_batched_tokens=64, **options), loaded)


def _one_by_one(engine, prompts) -> list[tuple[list[int], int]]:
    outs = []
    for prompt in prompts:
        rid = engine.add_request(prompt, GREEDY)
        out = None
        while engine.has_unfinished_requests():
            out = next((o for o in engine.step() if o.request_id == rid and o.finished), out)
        outs.append((out.token_ids, out.metrics.cached_tokens))
    return outs


def _batched(engine, prompts, abort_after: int | None = None) -> tuple[dict[str, list[int]], int]:
    """Run prompts together; the last is aborted after `abort_after` output tokens. Returns the finished outputs
    and the most blocks a sequence held while decoding."""
    ids = [engine.add_request(p, LONG) for p in prompts]
    done, most = {}, 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.token_ids
        for seq in engine.scheduler.running:
            if seq.num_output_tokens > 1:
                most = max(most, len(engine.kv.block_table(seq)))
            if seq.request_id == ids[-1] and abort_after is not None and seq.num_output_tokens >= abort_after:
                engine.abort(seq.request_id)
                break
    return done, most


def _assert_nothing_left(engine) -> None:
    kv = engine.kv
    tree = kv.prefix_tree
    assert kv.allocator.num_used == (tree.cached_blocks if tree is not None else 0)
    assert kv.state_pool.num_free == kv.state_pool.num_slots and not kv.requests
    kv.allocator.check()


@pytest.mark.parametrize("fmt,options", UNSTAGED + STAGED, ids=[f for f, _ in UNSTAGED + STAGED])
def test_formats_run_on_a_hybrid_and_leak_nothing(hybrid, fmt, options, tmp_path):
    plain = _one_by_one(_engine(hybrid, enable_prefix_caching=False), PROMPTS)
    kw = {"kv_cache_dtype": fmt, "kv_cache_options": options}
    off = _one_by_one(_engine(hybrid, enable_prefix_caching=False, **kw), PROMPTS)
    cached_engine = _engine(hybrid, **kw)
    on = _one_by_one(cached_engine, PROMPTS)
    assert [hit for _, hit in on] == [0, 64, 32, 64]
    first = _engine(hybrid, kv_tiers=[f"disk:{tmp_path}:64MiB"], **kw)
    _one_by_one(first, PROMPTS[:1])
    first.close()
    tiered = _engine(hybrid, kv_tiers=[f"disk:{tmp_path}:64MiB"], **kw)
    from_disk = _one_by_one(tiered, PROMPTS)
    assert [hit for _, hit in from_disk] == [64, 64, 32, 64]
    if fmt == "fp32":
        assert off == plain
    if (fmt, options) in UNSTAGED:
        assert [t for t, _ in on] == [t for t, _ in from_disk] == [t for t, _ in off]
    else:  # deterministic, fewer bytes than fp32: more blocks in one budget
        assert _one_by_one(_engine(hybrid, **kw), PROMPTS) == on
    assert cached_engine.kv.num_blocks >= _engine(hybrid).kv.num_blocks * (1 if fmt == "fp32" else 2) - 1
    _batched(cached_engine, [PROMPT[:50] + OTHER[:i] for i in (3, 9, 17)], abort_after=5)
    for engine in (cached_engine, tiered):
        _assert_nothing_left(engine)
    tiered.close()


@pytest.mark.parametrize("policy", POLICIES)
def test_policies_free_blocks_on_a_hybrid_as_on_an_attention_model(hybrid, attention, policy):
    budget, prompts = 48, [PROMPT, PROMPT[30:] + OTHER, PROMPT[:60]]
    held = {}
    for name, loaded in (("hybrid", hybrid), ("attention", attention)):
        engine = _engine(loaded, kv_policy=policy, kv_policy_options={"budget": budget})
        done, held[name] = _batched(engine, prompts, abort_after=10)
        assert len(done) == 2 and engine.stats()["kv_evicted_tokens"] > 0
        if name == "hybrid":
            _assert_nothing_left(engine)
    assert held["hybrid"] == held["attention"] < blocks_for_tokens(len(PROMPT) + LONG.max_tokens, 16)
    if policy != "snapkv":  # snapkv compresses the prompt once; its output is kept
        assert held["hybrid"] <= blocks_for_tokens(budget + SLACK + 1, 16)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_policy_with_room_for_everything_equals_plain_decoding(hybrid, policy):
    prompts = [PROMPT, PROMPT[30:] + OTHER]
    want, _ = _batched(_engine(hybrid, enable_prefix_caching=False), prompts)
    engine = _engine(hybrid, kv_policy=policy, kv_policy_options={"budget": 1000})
    got, _ = _batched(engine, prompts)
    assert sorted(got.values()) == sorted(want.values())
    assert engine.stats()["kv_evicted_tokens"] == 0
    _assert_nothing_left(engine)


def test_kvzip_stays_refused_on_a_hybrid(hybrid):
    with pytest.raises(ConfigError, match="recurrent layers"):
        _engine(hybrid, kv_policy="kvzip")


@pytest.fixture(scope="module")
def nope_hybrid(tmp_path_factory):
    d = tmp_path_factory.mktemp("granite-hybrid-nope")
    write_tiny_model("granite-hybrid-nope", d)
    return load_model(str(d))


def _sink_keys(engine, seq) -> torch.Tensor:
    """Attention layer 0's cached keys of seq's first 4 rows (its sinks)."""
    slots = torch.tensor(engine.kv.slots(seq, 0, 4))
    return engine.kv.pool.layers[0].read_rows(slots, engine.kv.block_size)[0]


def test_streaming_on_a_nope_hybrid_keeps_its_keys_unturned(nope_hybrid):
    """Granite 4.0-H has no positions in its keys (NoPE): streaming's compaction must not turn the sink keys by
    RoPE; they stay as a run without eviction wrote them."""
    full = _engine(nope_hybrid)
    evicting = _engine(nope_hybrid, kv_policy="streaming", kv_policy_options={"budget": 32})
    seqs = []
    for engine in (full, evicting):
        seq = engine.requests[engine.add_request(PROMPT, LONG)]
        while seq.num_output_tokens < 20:
            engine.step()
        seqs.append(seq)
    assert evicting.stats()["kv_evicted_tokens"] > 0
    assert torch.equal(_sink_keys(full, seqs[0]), _sink_keys(evicting, seqs[1]))
