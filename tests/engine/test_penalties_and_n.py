"""Presence / frequency / repetition penalties (batched) against a per-token reference; n samples; seeding."""
from __future__ import annotations

import pytest
import torch

from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.engine.sampler import apply_penalties
from kvforge.engine.sequence import Sequence
from kvforge.errors import InvalidRequestError
from kvforge.llm import LLM
from kvforge.sampling_params import SamplingParams

VOCAB = 50


def seq(prompt: list[int], output: list[int], **penalties) -> Sequence:
    s = Sequence("r", None, prompt, SamplingParams(**penalties), 0.0)
    s.token_ids += output
    return s


def reference(logits: torch.Tensor, s: Sequence) -> torch.Tensor:
    p, out = s.params, s.token_ids[len(s.prompt_token_ids):]
    row = logits.clone()
    for t in set(s.token_ids):
        row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
    for t in set(out):
        row[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
    return row


def test_batched_penalties_equal_the_per_token_definition():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, VOCAB, generator=g) * 3
    seqs = [seq([1, 2, 3], [4, 4, 5, 1], presence_penalty=0.5, frequency_penalty=0.7),
            seq([7, 8], [9], repetition_penalty=1.3),
            seq([1, 2], [2, 2]),  # no penalty: untouched
            seq([10], [11, 12, 11, 11], presence_penalty=-0.4, frequency_penalty=1.1, repetition_penalty=0.8)]
    got = apply_penalties(logits, seqs)
    for i, s in enumerate(seqs):
        assert torch.allclose(got[i], reference(logits[i], s), atol=1e-6)
    assert torch.equal(got[2], logits[2])
    assert apply_penalties(logits, [seqs[2]] * 4) is logits  # nobody asked: no copy, no work


@pytest.mark.parametrize("field, value", [("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0),
                                          ("n", 0)])
def test_penalty_and_n_bounds(field, value):
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**{field: value})


def test_n_samples_are_seed_plus_j_and_the_engine_takes_one(tiny_loaded):
    llm = LLM.from_engine(LLMEngine(EngineConfig(kv_cache_memory=8 << 20, max_model_len=128), tiny_loaded))
    out = llm.generate([[1, 2, 3]], SamplingParams(n=3, seed=11, max_tokens=6))[0]
    assert len(out.outputs) == 3 and out.outputs[0].token_ids == out.token_ids
    for j, o in enumerate(out.outputs):
        single = llm.generate([[1, 2, 3]], SamplingParams(seed=11 + j, max_tokens=6))[0]
        assert o.token_ids == single.token_ids and o.index == j
    with pytest.raises(InvalidRequestError, match="n=2"):
        llm.engine.add_request([1, 2], SamplingParams(n=2))
    assert llm.engine.kv.stats()["kv_blocks_used"] == 0


def test_unseeded_engines_differ_and_an_engine_seed_reproduces(tiny_loaded):
    def sample(seed):
        engine = LLMEngine(EngineConfig(kv_cache_memory=8 << 20, max_model_len=128, seed=seed), tiny_loaded)
        return LLM.from_engine(engine).generate([[1, 2, 3]], SamplingParams(max_tokens=24))[0].token_ids

    assert sample(None) != sample(None)
    assert sample(5) == sample(5)


def test_penalties_under_speculative_decoding_equal_plain_decoding(tiny_loaded):
    """Penalised requests decode one token at a time even when the engine speculates, so outputs match."""
    # mild, so the output still repeats and n-gram lookup would draft (stronger penalties leave nothing to draft)
    params = SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.1, ignore_eos=True)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]  # n-gram lookup would draft here

    def run(**options):
        engine = LLMEngine(EngineConfig(kv_cache_memory=8 << 20, max_model_len=128, **options), tiny_loaded)
        return LLM.from_engine(engine).generate([prompt], params)[0].token_ids

    assert run(speculative={"method": "ngram", "num_speculative_tokens": 3}) == run()
