"""The official openai client against a live server: greedy results equal the offline LLM API."""
import httpx
import pytest

from kvforge.sampling_params import SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three colours:"]
MESSAGES = [{"role": "user", "content": "What is the boiling point of water?"}]
MAX_TOKENS = 12


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, **kw)


def test_completions_match_offline(client, offline, model_name):
    ref = offline.generate(PROMPTS, greedy())
    for prompt, want in zip(PROMPTS, ref):
        r = client.completions.create(model=model_name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert r.choices[0].text == want.text
        assert r.choices[0].finish_reason == want.finish_reason
        assert r.usage.prompt_tokens == len(want.prompt_token_ids)
        assert r.usage.completion_tokens == len(want.token_ids)


def test_streamed_completion_matches_offline(client, offline, model_name):
    want = offline.generate(PROMPTS[1], greedy())[0]
    stream = client.completions.create(model=model_name, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want.finish_reason
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)
    assert len([c for c in chunks if c.choices]) >= 2, "tokens arrive incrementally"


@pytest.mark.parametrize("stream", [False, True])
def test_chat_matches_offline(client, offline, model_name, stream):
    want = offline.chat(MESSAGES, greedy())[0]
    r = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
                                       stream=stream)
    if stream:
        chunks = list(r)
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        reason = chunks[-1].choices[0].finish_reason
    else:
        text, reason = r.choices[0].message.content, r.choices[0].finish_reason
        assert r.choices[0].message.role == "assistant"
        assert r.usage.completion_tokens == len(want.token_ids)
    assert text == want.text and reason == want.finish_reason


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_is_cut_and_never_streamed(client, offline, model_name, stream):
    want = offline.generate(PROMPTS[0], greedy(stop=["is"]))[0]
    r = client.completions.create(model=model_name, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                  stop=["is"], stream=stream)
    text = "".join(c.choices[0].text for c in r) if stream else r.choices[0].text
    assert text == want.text and "is" not in text


def test_n_and_batched_prompts(client, offline, model_name):
    ref = offline.generate(PROMPTS[:2], greedy())
    r = client.completions.create(model=model_name, prompt=PROMPTS[:2], n=2, max_tokens=MAX_TOKENS, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [ref[0].text, ref[0].text, ref[1].text, ref[1].text]
    assert r.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in ref)
    stream = client.completions.create(model=model_name, prompt=PROMPTS[0], n=2, max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True)
    texts = ["", ""]
    for chunk in stream:
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == [ref[0].text, ref[0].text]


def test_seeded_sampling_is_reproducible(client, model_name):
    def run():
        r = client.completions.create(model=model_name, prompt=PROMPTS[2], max_tokens=8, temperature=1.0, top_p=0.9,
                                      seed=1234, n=2)
        return [c.text for c in r.choices]

    assert run() == run()


def test_logprobs(client, model_name):
    r = client.completions.create(model=model_name, prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(top) == 3 and max(top.values()) <= 0 for top in lp.top_logprobs)
    c = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=3, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)


def test_models_tokenize_detokenize(client, server, model_name, offline):
    assert [m.id for m in client.models.list().data] == [model_name]
    ids = httpx.post(server.url + "/tokenize", json={"prompt": PROMPTS[0]}).json()
    assert ids["tokens"] == offline.get_tokenizer().encode(PROMPTS[0]) and ids["count"] == len(ids["tokens"])
    back = httpx.post(server.url + "/detokenize", json={"tokens": ids["tokens"]}).json()
    assert back["prompt"] == PROMPTS[0]
    chat = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}).json()
    assert chat["tokens"] == offline.render_chat(MESSAGES)
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
