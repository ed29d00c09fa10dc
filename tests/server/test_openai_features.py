"""Features as OpenAI clients and evaluation harnesses use them: penalties, echo with prompt logprobs,
unsupported features (functions, other response_format types, guided_*) refused with a 400 (never ignored)."""
from __future__ import annotations

import math

import openai
import pytest

from kvforge.sampling_params import SamplingParams

PROMPT = "The list of fruits: apple, banana, apple, banana, apple,"


def test_penalties_match_the_offline_engine_and_change_the_output(client, offline, model_name):
    plain = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=16, temperature=0)
    kw = {"presence_penalty": 1.0, "frequency_penalty": 1.5}
    penalized = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=16, temperature=0, **kw,
                                          extra_body={"repetition_penalty": 1.3})
    want = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.3, **kw))[0]
    assert penalized.choices[0].text == want.text
    assert penalized.choices[0].text != plain.choices[0].text


def test_echo_scores_the_prompt_like_decode_does(client, model_name):
    gen = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=1)
    decoded_lp = gen.choices[0].logprobs.token_logprobs[0]
    full = PROMPT + gen.choices[0].text
    scored = client.completions.create(model=model_name, prompt=full, max_tokens=0, echo=True, logprobs=1)
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text == full
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == full
    # the last prompt token, scored in one pass, has the logprob decode gave it when it was generated
    assert math.isclose(lp.token_logprobs[-1], decoded_lp, abs_tol=1e-3)
    assert scored.usage.completion_tokens == 0


def test_echo_with_generation_prefixes_text_and_logprobs(client, offline, model_name):
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=0)
    want = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4))[0]
    c = r.choices[0]
    assert c.text == PROMPT + want.text
    assert len(c.logprobs.tokens) == len(want.prompt_token_ids) + len(want.token_ids)
    assert c.logprobs.text_offset[len(want.prompt_token_ids)] == len(PROMPT)


@pytest.mark.parametrize("max_tokens", [0, 4])
def test_streamed_echo_equals_the_whole_response(client, model_name, max_tokens):
    kw = {"model": model_name, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "echo": True,
          "logprobs": 1}
    whole = client.completions.create(**kw).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**kw, stream=True) if c.choices]
    assert chunks[0].text == PROMPT  # the prompt comes first, then what is generated
    assert "".join(c.text for c in chunks) == whole.text
    tokens = [t for c in chunks if c.logprobs for t in c.logprobs.tokens]
    offsets = [o for c in chunks if c.logprobs for o in c.logprobs.text_offset]
    scores = [x for c in chunks if c.logprobs for x in c.logprobs.token_logprobs]
    assert tokens == whole.logprobs.tokens and offsets == whole.logprobs.text_offset
    assert scores[0] is None and whole.logprobs.token_logprobs[0] is None
    assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(scores[1:], whole.logprobs.token_logprobs[1:]))
    assert chunks[-1].finish_reason == "length"


@pytest.mark.parametrize("extra", [
    {"functions": [{"name": "get_weather", "parameters": {"type": "object"}}]},
    {"response_format": {"type": "grammar"}},
    {"extra_body": {"guided_json": {"type": "object"}}},
])
def test_unsupported_chat_features_are_refused_not_ignored(client, model_name, extra):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       **extra)
    assert "not supported" in e.value.message  # (json_object, json_schema and tools: test_structured_output.py)
    ok = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                        response_format={"type": "text"})
    assert ok.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("extra", [{"suffix": " and that is all."}, {"best_of": 3}, {"logit_bias": {"42": 5}}])
def test_unsupported_completion_features_are_refused_not_ignored(client, model_name, extra):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_name, prompt=PROMPT, max_tokens=4, **extra)
    assert "not supported" in e.value.message
