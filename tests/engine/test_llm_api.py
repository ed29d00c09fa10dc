"""The Python API as vLLM users write it: dict params, the model's default sampling, vLLM-shaped logprobs, min_p,
and the budget options refused together as on the command line."""
import json
import shutil

import pytest

from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.errors import ConfigError, InvalidRequestError
from kvforge.llm import LLM
from kvforge.models.loader import load_model
from kvforge.outputs import Logprob
from kvforge.sampling_params import SamplingParams

PROMPT = [5, 6, 7, 8]


def make_llm(loaded) -> LLM:
    return LLM.from_engine(LLMEngine(EngineConfig(kv_cache_memory=1 << 22, block_size=4, max_model_len=128), loaded))


def test_dict_params_and_clear_type_errors(tiny_loaded):
    llm = make_llm(tiny_loaded)
    got = llm.generate(PROMPT, {"max_tokens": 6, "seed": 3})[0]
    assert got.token_ids == llm.generate(PROMPT, SamplingParams(max_tokens=6, seed=3))[0].token_ids
    with pytest.raises(InvalidRequestError, match="unknown sampling field.*max_token"):
        llm.generate(PROMPT, {"max_token": 2})
    with pytest.raises(TypeError, match="SamplingParams, a dict"):
        llm.generate(PROMPT, 2)


def test_budget_and_fraction_together_are_refused():
    with pytest.raises(ConfigError, match="kv_cache_memory .* or gpu_memory_utilization"):
        LLM(kv_cache_memory="64MiB", gpu_memory_utilization=0.5)


def test_logprobs_in_vllms_shape(tiny_loaded):
    out = make_llm(tiny_loaded).generate(PROMPT, SamplingParams(max_tokens=5, temperature=0, logprobs=2))[0]
    sample = out.outputs[0].logprobs
    assert len(sample) == len(out.token_ids) == 5
    for token, position, raw in zip(out.token_ids, sample, out.logprobs):
        assert token in position and isinstance(position[token], Logprob)
        assert position[token].logprob == raw["logprob"] and position[token].rank == 1  # greedy: the top token
        assert sorted(p.rank for p in position.values()) == [1, 2]  # top-2, the sampled token among them
        assert position[token].decoded_token == raw["token"]


def test_min_p_one_keeps_only_the_most_likely_token(tiny_loaded):
    llm = make_llm(tiny_loaded)
    sampled = llm.generate(PROMPT, SamplingParams(max_tokens=8, seed=1, min_p=1.0))[0].token_ids
    assert sampled == llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0))[0].token_ids
    with pytest.raises(InvalidRequestError, match="min_p must be in"):
        SamplingParams(min_p=-0.1)


def test_generate_without_params_uses_generation_config(tiny_dir, tmp_path):
    shutil.copytree(tiny_dir, tmp_path / "m")
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "top_k": 7}))
    llm = make_llm(load_model(str(tmp_path / "m")))
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, top_k=7)
    assert llm.generate(PROMPT)[0].token_ids == llm.generate(PROMPT, SamplingParams(temperature=0))[0].token_ids
    assert llm.generate(PROMPT, {"max_tokens": 3})[0].token_ids == llm.generate(PROMPT)[0].token_ids[:3]
