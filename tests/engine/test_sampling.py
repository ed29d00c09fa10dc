"""Sampling: greedy, seeds, top-k / top-p, stop conditions, outputs in order."""
from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.llm import LLM
from kvforge.sampling_params import SamplingParams


def make_llm(loaded, **kw):
    return LLM.from_engine(LLMEngine(EngineConfig(kv_cache_memory=1 << 22, block_size=4, max_model_len=128, **kw), loaded))


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_loaded):
    llm = make_llm(tiny_loaded)
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=7, max_tokens=12, ignore_eos=True)
    alone = llm.generate([[3, 4, 5]], p)[0].token_ids
    batched = llm.generate([[9, 9, 9, 9], [3, 4, 5], [1, 2]], [SamplingParams(temperature=1.0, seed=1, max_tokens=12), p,
                                                              SamplingParams(temperature=0, max_tokens=3)])
    assert batched[1].token_ids == alone
    other_seed = llm.generate([[3, 4, 5]], SamplingParams(temperature=1.0, seed=8, max_tokens=12, ignore_eos=True))[0]
    assert other_seed.token_ids != alone


def test_top_k_one_is_greedy(tiny_loaded):
    llm = make_llm(tiny_loaded)
    greedy = llm.generate([[7, 8, 9]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0].token_ids
    topk1 = llm.generate([[7, 8, 9]], SamplingParams(temperature=0.8, top_k=1, seed=3, max_tokens=10, ignore_eos=True))[0]
    assert topk1.token_ids == greedy


def test_stop_token_ids_and_max_tokens(tiny_loaded):
    llm = make_llm(tiny_loaded)
    full = llm.generate([[7, 8, 9]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 10
    stop_at = full.token_ids[4]
    first = full.token_ids.index(stop_at)
    out = llm.generate([[7, 8, 9]], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_at]))[0]
    assert out.finish_reason == "stop" and out.token_ids == full.token_ids[: first + 1]


def test_outputs_in_prompt_order_with_metrics(tiny_loaded):
    llm = make_llm(tiny_loaded)
    prompts = [[5] * n for n in (30, 2, 17)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert [o.prompt_token_ids for o in outs] == prompts
    for o in outs:
        assert o.metrics.ttft is not None and o.metrics.ttft >= 0
        assert o.metrics.prompt_tokens == len(o.prompt_token_ids) and o.metrics.generated_tokens == 4
