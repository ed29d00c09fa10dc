"""Structured output in the engine (engine/grammar.py): grammar masks in the sampler, batched and per request, and
jump-forward (forced tokens as one prefill chunk) token-identical to one masked decode step per forced token."""
import json

import pytest

from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.engine.grammar import GrammarError
from kvforge.errors import InvalidRequestError
from kvforge.sampling_params import SamplingParams

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"enum": ["Paris", "London", "Berlin"]}},
          "required": ["name", "age", "city"], "additionalProperties": False}
TOOL_CALL = {"type": "object", "properties": {"name": {"const": "get_weather"},
                                              "arguments": {"type": "object", "properties": {"city": {"type": "string"}},
                                                            "required": ["city"], "additionalProperties": False}},
             "required": ["name", "arguments"], "additionalProperties": False}
GRAMMARS = [{"json": PERSON}, {"json": TOOL_CALL}, {"json_object": True}, None]
PROMPTS = ["Give me a person as JSON.", "What is the weather in Paris? Call the tool.", "Describe a cat in JSON.",
           "Say hello."]


def _engine(loaded) -> LLMEngine:
    return LLMEngine(EngineConfig(kv_cache_memory=64 << 20, max_model_len=512), loaded)


def _prompt(loaded, text: str) -> list[int]:
    tok = loaded.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)


def _run(engine: LLMEngine, loaded, jump_forward: bool, which=None) -> tuple[list, int]:
    which = range(len(GRAMMARS)) if which is None else which
    ids = [engine.add_request(_prompt(loaded, PROMPTS[i]), SamplingParams(
        temperature=0, max_tokens=48 if GRAMMARS[i] else 8, structured_outputs=GRAMMARS[i],
        jump_forward=jump_forward)) for i in which]
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
        steps += 1
    return [done[i] for i in ids], steps


def test_jump_forward_is_token_identical_to_masking_step_by_step(smol_loaded):
    stepwise_engine, jumping_engine = _engine(smol_loaded), _engine(smol_loaded)
    stepwise, _ = _run(stepwise_engine, smol_loaded, jump_forward=False)
    jumping, _ = _run(jumping_engine, smol_loaded, jump_forward=True)
    assert [o.token_ids for o in jumping] == [o.token_ids for o in stepwise]
    assert jumping_engine.stats()["jump_forward_tokens"] > 10 and stepwise_engine.stats()["jump_forward_tokens"] == 0
    # the schemas force their keys and punctuation: those requests alone finish in fewer steps
    _, schema_steps_stepwise = _run(stepwise_engine, smol_loaded, jump_forward=False, which=[0, 1])
    _, schema_steps_jumping = _run(jumping_engine, smol_loaded, jump_forward=True, which=[0, 1])
    assert schema_steps_jumping < 0.75 * schema_steps_stepwise
    person, call, anything = (json.loads(o.text) for o in jumping[:3])
    assert set(person) == {"name", "age", "city"} and isinstance(person["age"], int) and person["city"] in PERSON[
        "properties"]["city"]["enum"]
    assert call["name"] == "get_weather" and isinstance(call["arguments"]["city"], str)
    assert isinstance(anything, dict)
    assert all(o.finish_reason == "stop" for o in jumping[:3])
    for engine in (stepwise_engine, jumping_engine):
        assert engine.kv.allocator.num_used == engine.kv.prefix_tree.cached_blocks  # no leaked block
        engine.close()


def test_each_request_keeps_its_own_grammar_in_a_batch(smol_loaded):
    engine = _engine(smol_loaded)
    batched, _ = _run(engine, smol_loaded, jump_forward=True)
    alone = [_run(engine, smol_loaded, jump_forward=True, which=[i])[0][0] for i in range(len(GRAMMARS))]
    assert [o.token_ids for o in batched] == [o.token_ids for o in alone]
    engine.close()


def test_a_grammar_that_fails_fails_its_request_alone(smol_loaded):
    engine = _engine(smol_loaded)
    broken = engine.add_request(_prompt(smol_loaded, PROMPTS[0]), SamplingParams(
        temperature=0, max_tokens=32, structured_outputs={"json": PERSON}))
    fine = engine.add_request(_prompt(smol_loaded, PROMPTS[0]), SamplingParams(
        temperature=0, max_tokens=32, structured_outputs={"json": PERSON}))

    def refuse(token):
        raise GrammarError(f"structured output: the grammar refused token {token}")

    engine.requests[broken].grammar.accept = refuse
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done[broken].finish_reason == "error" and "refused" in done[broken].error
    assert done[fine].finish_reason == "stop" and set(json.loads(done[fine].text)) == {"name", "age", "city"}
    assert engine.kv.allocator.num_used == engine.kv.prefix_tree.cached_blocks
    engine.close()


@pytest.mark.parametrize("spec, message", [
    ({"json": {"type": "nonsense"}}, "structured output"),
    ({"grammar": "start: ("}, "structured output"),
])
def test_a_grammar_that_does_not_compile_is_refused(smol_loaded, spec, message):
    engine = _engine(smol_loaded)
    with pytest.raises(InvalidRequestError, match=message):
        engine.add_request([1, 2, 3], SamplingParams(structured_outputs=spec))
    assert not engine.requests
    engine.close()


@pytest.mark.parametrize("spec", [{"regex": "a+"}, {"json": 3}, {"json_object": False}, {"grammar": 1}, "json",
                                  {"json": {}, "grammar": "x"}])
def test_structured_outputs_must_name_one_grammar(spec):
    with pytest.raises(InvalidRequestError, match="structured_outputs"):
        SamplingParams(structured_outputs=spec)


def test_structured_output_with_speculative_decoding_is_refused(tiny_loaded):
    engine = LLMEngine(EngineConfig(kv_cache_memory=8 << 20, max_model_len=128,
                                    speculative={"method": "ngram", "num_speculative_tokens": 3}), tiny_loaded)
    with pytest.raises(InvalidRequestError, match="speculative decoding"):
        engine.add_request([1, 2, 3], SamplingParams(structured_outputs={"json_object": True}))
    assert not engine.requests and engine.scheduler.waiting == type(engine.scheduler.waiting)()
    engine.close()
