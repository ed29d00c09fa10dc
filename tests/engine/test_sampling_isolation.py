"""One request's sampling parameters or unusable logits never fail another request of the same step."""
import pytest
import torch

from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.errors import ConfigError, InvalidRequestError
from kvforge.sampling_params import SamplingParams

A, B = [3, 4, 5, 6, 7], [9, 10, 11]
D = list(range(40, 50))  # the tiny model repeats a token after it: n-gram speculation drafts from it
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)


def make_engine(loaded, **options) -> LLMEngine:
    return LLMEngine(EngineConfig(kv_cache_memory=1 << 22, block_size=4, max_model_len=128, **options), loaded)


def run(engine: LLMEngine, requests: dict, check_blocks: bool = True) -> dict:
    for rid, (prompt, params) in requests.items():
        engine.add_request(prompt, params, rid)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    if check_blocks:
        engine.kv.reset_prefix_cache()
        assert engine.kv.allocator.num_used == 0
    return finals


@pytest.fixture(scope="module")
def alone(tiny_loaded) -> dict:
    engine = make_engine(tiny_loaded)
    return {rid: run(engine, {rid: (prompt, params)})[rid].token_ids
            for rid, prompt, params in (("a", A, GREEDY), ("b", B, GREEDY), ("s", B, SEEDED))}


def test_a_tiny_temperature_is_greedy_and_fails_nobody(tiny_loaded, alone):
    tiny = SamplingParams(temperature=1e-39, max_tokens=8, ignore_eos=True)
    assert tiny.greedy
    finals = run(make_engine(tiny_loaded), {"a": (A, tiny), "b": (B, GREEDY), "s": (B, SEEDED)})
    assert {rid: (o.finish_reason, o.token_ids) for rid, o in finals.items()} == {
        "a": ("length", alone["a"]), "b": ("length", alone["b"]), "s": ("length", alone["s"])}


@pytest.mark.parametrize("value", [1e-39, 0.0099, 101.0, float("inf"), float("nan")])
def test_degenerate_repetition_penalty_is_refused_with_the_range(value):
    with pytest.raises(InvalidRequestError, match=r"repetition_penalty must be in \[0.01, 100.0\]"):
        SamplingParams(repetition_penalty=value)


@pytest.mark.parametrize("field, value", [("temperature", float("inf")), ("temperature", 10**400),
                                          ("presence_penalty", float("-inf"))])
def test_non_finite_numbers_are_refused(field, value):
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**30, True, 1.5])
def test_seed_out_of_the_generators_range_is_refused(seed):
    with pytest.raises(InvalidRequestError, match=r"seed must be None or an integer in \[-2\*\*63, 2\*\*64 - 1\]"):
        SamplingParams(seed=seed)


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, True])
def test_an_engine_seed_out_of_range_is_a_config_error(seed):
    with pytest.raises(ConfigError, match=r"seed must be None or an integer in \[-2\*\*63, 2\*\*64 - 1\]"):
        EngineConfig(seed=seed)


def test_n_seeds_must_fit_the_range_too():
    assert SamplingParams(n=3, seed=2**64 - 3).seed == 2**64 - 3
    with pytest.raises(InvalidRequestError, match="seed..seed.n-1"):
        SamplingParams(n=3, seed=2**64 - 2)


@pytest.mark.parametrize("seed", [2**64 - 1, -(2**63)])
def test_seed_at_the_ends_of_the_range_runs(tiny_loaded, seed):
    params = SamplingParams(temperature=1.0, seed=seed, max_tokens=4, ignore_eos=True)
    finals = run(make_engine(tiny_loaded), {"a": (A, params)})
    assert finals["a"].finish_reason == "length" and len(finals["a"].token_ids) == 4


def test_unusable_logits_fail_their_request_only(tiny_loaded, alone, caplog):
    """A penalty past validation (set after construction) turns a sampled row's logits to NaN: that request
    ends with 'error'; the greedy and seeded requests of the same steps get exactly their tokens."""
    broken = SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True, repetition_penalty=1.5)
    broken.repetition_penalty = float("nan")
    engine = make_engine(tiny_loaded)
    finals = run(engine, {"x": (A, broken), "b": (B, GREEDY), "s": (B, SEEDED)}, check_blocks=False)
    assert (finals["x"].finish_reason, finals["x"].token_ids) == ("error", [])
    assert "not finite" in finals["x"].error
    assert (finals["b"].token_ids, finals["s"].token_ids) == (alone["b"], alone["s"])
    again = run(engine, {"a": (A, GREEDY)})["a"]
    assert again.metrics.cached_tokens == 0  # the failed step's full block of A never entered the prefix cache
    assert again.token_ids == alone["a"]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_unusable_logits_while_verifying_drafts_fail_that_request_only(tiny_loaded, alone, temperature, monkeypatch):
    params = SamplingParams(temperature=temperature, top_k=1, max_tokens=8, ignore_eos=True)  # 1.0: verify_sampled
    engine = make_engine(tiny_loaded, speculative={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False})
    verify, verified = engine.runner.speculator.verify, []

    def nan_for_r(seq, logits, drafts):
        verified.append(seq.request_id)
        return verify(seq, torch.full_like(logits, float("nan")) if seq.request_id == "r" else logits, drafts)

    monkeypatch.setattr(engine.runner.speculator, "verify", nan_for_r)
    finals = run(engine, {"r": (D, params), "b": (B, GREEDY)})
    assert "r" in verified and finals["r"].finish_reason == "error" and "not finite" in finals["r"].error
    assert finals["b"].finish_reason == "length" and finals["b"].token_ids == alone["b"]


def test_unusable_rows_are_nan_or_inf_or_all_masked():
    from kvforge.engine.sampler import unusable_rows

    logits = torch.randn(6, 10)
    logits[0, 5] = float("-inf")  # masked out: still a distribution
    logits[1, 3] = float("nan")
    logits[2, 0] = float("inf")
    logits[3] = float("-inf")
    logits[4] = 3e38  # huge but finite (their sum is not)
    assert unusable_rows(logits) == [1, 2, 3]
    assert unusable_rows(logits[[0, 4, 5]]) == []
