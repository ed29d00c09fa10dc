"""The engine with the compiled decode operator gives the same greedy tokens as the torch path."""
import pytest

from kvforge import attention
from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.ops.build import load_compiled
from kvforge.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
PROMPTS = [[(7 * i + j) % 90 + 3 for j in range(5 + 9 * i)] for i in range(4)]
FORMATS = [("fp32", {}), ("bf16", {}), ("int4", {"group_size": 16}), ("kivi2", {"group_size": 16, "window": 8})]


def generate(loaded, fmt, opts, speculative=None, prompts=PROMPTS):
    config = EngineConfig(block_size=8, max_model_len=96, kv_cache_dtype=fmt, kv_cache_options=opts,
                          kv_cache_memory=1 << 22, enable_prefix_caching=False, speculative=speculative)
    engine = LLMEngine(config, loaded)
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    return [done[i] for i in ids]


@pytest.mark.parametrize("fmt,opts", FORMATS, ids=[f for f, _ in FORMATS])
def test_greedy_same_with_and_without_compiled_decode(tiny_loaded, monkeypatch, fmt, opts):
    if not load_compiled():
        pytest.skip("no compiled kvforge ops on this machine")
    calls = []
    compiled = attention.paged_decode

    def counted(*args):
        out = compiled(*args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(attention, "paged_decode", counted)
    on = generate(tiny_loaded, fmt, opts)
    assert calls and all(calls)  # every decode group went through the compiled operator
    monkeypatch.setenv("KVFORGE_OPS", "torch")
    calls.clear()
    off = generate(tiny_loaded, fmt, opts)
    assert calls and not any(calls)
    assert on == off


def test_speculative_verification_rows_through_the_operator(tiny_loaded, monkeypatch):
    """Rows of several queries go through the multi-query operator, each query over its causal prefix."""
    if not load_compiled():
        pytest.skip("no compiled kvforge ops on this machine")
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    prompts = [[5, 6, 7, 8, 9, 10] * 4, [11, 12, 13, 14] * 5 + [3]]
    calls = []
    compiled = attention.paged_attend

    def counted(q, cache, starts, *args):
        out = compiled(q, cache, starts, *args)
        calls.append((out is not None, int((starts[1:] - starts[:-1]).max())))
        return out

    monkeypatch.setattr(attention, "paged_attend", counted)
    on = generate(tiny_loaded, "int8", {}, spec, prompts)
    assert calls and all(ran for ran, _ in calls)
    assert max(most for _, most in calls) > 1  # some call carried a sequence's several verification queries
    monkeypatch.setenv("KVFORGE_OPS", "torch")
    assert on == generate(tiny_loaded, "int8", {}, spec, prompts) == generate(tiny_loaded, "int8", {}, None, prompts)
