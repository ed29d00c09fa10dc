"""Speculative decoding (ngram): lossless greedy output, exact sampling distribution, KV rollback, stops."""
import math

import pytest
import torch

from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.engine.speculative.ngram import propose_ngram
from kvforge.engine.speculative.verify import verify_greedy, verify_sampled
from kvforge.errors import ConfigError
from kvforge.kv.memory import pool_bytes
from kvforge.sampling_params import SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
PROMPTS = [[5, 6, 7, 8, 9, 10] * 4, [11, 12, 13, 14] * 5 + [3], list(range(20, 50)), [7, 3, 7, 3, 7, 3, 9]]
FORMATS = [("fp32", {}), ("fp16", {}), ("int8", {}), ("fp8_e4m3", {}), ("int4", {"group_size": 16}),
           ("kivi2", {"group_size": 16, "window": 8})]


def make(loaded, spec, blocks=None, **kw):
    options = {"block_size": 8, "max_model_len": 128, "max_num_batched_tokens": 64, "kv_cache_memory": 1 << 22,
               "speculative": spec, "kv_staging_share": 1.0, **kw}  # `blocks`: exactly that many
    e = LLMEngine(EngineConfig(**options), loaded)
    if blocks is not None:
        options["kv_cache_memory"] = pool_bytes(e.kv_spec, e.format, 8, blocks, e.config.max_num_seqs)
        e = LLMEngine(EngineConfig(**options), loaded)
    return e


def run(e, params=None, prompts=PROMPTS):
    params = params or SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ids = [e.add_request(p, params) for p in prompts]
    done = {}
    while e.has_unfinished_requests():
        done.update({o.request_id: o for o in e.step() if o.finished})
    tree = e.kv.prefix_tree
    assert e.kv.allocator.num_used == (tree.cached_blocks if tree is not None else 0)
    assert not e.kv.requests
    return [done[i] for i in ids]


@pytest.mark.parametrize("fmt,opts", FORMATS, ids=[f for f, _ in FORMATS])
def test_greedy_output_is_identical_with_speculation(tiny_loaded, fmt, opts):
    kw = {"kv_cache_dtype": fmt, "kv_cache_options": opts}
    off = run(make(tiny_loaded, None, **kw))
    on_engine = make(tiny_loaded, NGRAM, **kw)
    on = run(on_engine)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    s = on_engine.stats()
    assert s["spec_num_draft_tokens"] > s["spec_num_accepted_tokens"] > 0  # drafts were made, some kept, some rolled back
    assert s["spec_mean_acceptance_length"] == 1 + s["spec_num_accepted_tokens"] / s["spec_num_drafts"]


@pytest.mark.parametrize("case", ["no-prefix-cache", "preemption", "streaming", "h2o"])
def test_greedy_identical_under_composition(tiny_loaded, case):
    kw = {"no-prefix-cache": {"enable_prefix_caching": False},
          "preemption": {"blocks": 12, "max_model_len": 80, "max_num_batched_tokens": 16},
          "streaming": {"kv_policy": "streaming", "kv_policy_options": {"budget": 24, "sinks": 4, "slack": 4}},
          "h2o": {"kv_policy": "h2o", "kv_policy_options": {"budget": 24, "slack": 4}}}[case]
    off_engine = make(tiny_loaded, None, **kw)
    off = run(off_engine)
    on_engine = make(tiny_loaded, NGRAM, **kw)
    on = run(on_engine)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    if case == "preemption":
        assert on_engine.scheduler.num_preemptions > 0
    assert on_engine.stats()["spec_num_accepted_tokens"] > 0


def test_stop_string_inside_an_accepted_run_ends_output_there(tiny_loaded):
    prompt = [5, 6, 7, 8, 9, 10] * 4
    full = run(make(tiny_loaded, NGRAM), prompts=[prompt])[0]
    e = make(tiny_loaded, NGRAM)
    target = full.token_ids[6]  # a token in the middle of an accepted run
    stop_at = full.token_ids.index(target)
    out = run(e, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[target]),
              prompts=[prompt])[0]
    assert out.token_ids == full.token_ids[: stop_at + 1] and out.finish_reason == "stop"
    streamed = make(tiny_loaded, NGRAM)
    rid = streamed.add_request(prompt, SamplingParams(temperature=0, max_tokens=11, ignore_eos=True))
    pieces = []
    while streamed.has_unfinished_requests():
        pieces += [t for o in streamed.step() if o.request_id == rid for t in o.new_token_ids]
    assert pieces == full.token_ids[:11]


def test_ngram_proposes_the_continuation_of_the_latest_match():
    assert propose_ngram([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 3, 1, 3) == [7, 1, 2]
    assert propose_ngram([1, 2, 3, 4], 3, 1, 3) == []
    assert propose_ngram([4, 5, 4], 5, 1, 2) == [5, 4]


def test_greedy_verification_accepts_the_matching_prefix():
    logits = torch.full((4, 10), -1.0)
    for row, tok in enumerate([3, 4, 8, 1]):
        logits[row, tok] = 1.0
    assert verify_greedy(logits, [3, 4, 5]) == [3, 4, 8]
    assert verify_greedy(logits, [3, 4, 8]) == [3, 4, 8, 1]
    assert verify_greedy(logits, [9, 4, 8]) == [3]


def test_rejection_sampling_reproduces_the_target_distribution():
    """Chi-square of the first two emitted tokens against the target's own distribution."""
    vocab, n = 6, 20000
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(3, vocab, generator=gen), -1)
    drafts = [int(probs[0].argmin()), 2]  # a draft the target rarely agrees with, then any
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)
    for _ in range(n):
        out = verify_sampled(probs, drafts, gen)
        first[out[0]] += 1
        if out[0] == drafts[0]:
            second[out[1]] += 1
    for counts, p in ((first, probs[0]), (second, probs[1])):
        expected = counts.sum() * p
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < 20.5  # 99.9% quantile of chi-square with 5 degrees of freedom
    assert math.isclose(float(first[drafts[0]]) / n, float(probs[0, drafts[0]]), abs_tol=0.01)


def test_seeded_sampling_with_speculation_is_reproducible(tiny_loaded):
    params = SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True, seed=7)
    a = run(make(tiny_loaded, NGRAM), params)
    b = run(make(tiny_loaded, NGRAM), params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


@pytest.mark.parametrize("spec, match", [
    ({"method": "eagle"}, "not supported"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "ngram", "lookahead": 3}, "unknown options"),
    ({"method": "ngram", 1: 3}, "unknown options 1"),
    ({"method": ["ngram"]}, "not supported"),
    ({"method": "layer_skip", "layers": [0.5]}, "layers must be .*integers >= 0, not booleans or floats"),
    ({"method": "layer_skip", "layers": ["a"]}, "layers must be"),
    ({"method": "layer_skip", "layers": [True]}, "layers must be"),
    ({"method": "layer_skip", "layers": [-1, 0]}, "layers must be"),
    ({"method": "layer_skip", "layers": [1, 0]}, "ascending"),
    ({"method": "layer_skip", "layers": []}, "non-empty"),
    ({"method": "layer_skip", "layers": "01"}, "layers must be"),
    ({"method": "layer_skip", "num_layers": True}, "num_layers must be integers >= 1"),
    ({"method": "layer_skip", "num_layers": 2.0}, "num_layers"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 3.0}, "num_speculative_tokens"),
    ({"method": "ngram", "disable_by_batch_size": -2}, "disable_by_batch_size"),
    ({"method": "ngram", "probe_interval": 0}, "probe_interval"),
    ({"method": "ngram", "adaptive": "yes"}, "adaptive"),
    ({"method": "ngram", "verify_row_cost": float("nan")}, "verify_row_cost"),
    ({"method": "ngram", "bridge_jump": True}, "bridge_jump"),
    ({"method": "ngram", "bridge_row_cost": 10**400}, "bridge_row_cost"),
    ({"method": "ngram", "acceptance_smoothing": 0}, "acceptance_smoothing"),
    ({"method": "draft", "model": 3}, "needs model"),
])
def test_bad_speculative_options(spec, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig(speculative=spec)
