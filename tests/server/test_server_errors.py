"""Bad requests get clear 4xx errors in OpenAI's shape, and the server keeps serving."""
import httpx
import openai
import pytest

BAD = [
    # (path, raw body, status, param, words in the message)
    ("/v1/completions", b'{"prompt": "hi", ', 400, None, "not valid JSON"),
    ("/v1/completions", b'{"prompt": "\xff\xfe hi"}', 400, None, "not valid UTF-8"),
    ("/v1/completions", b'[1, 2]', 400, None, "JSON object"),
    ("/v1/completions", b'{"max_tokens": 4}', 400, "prompt", "prompt"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": "many"}', 400, "max_tokens", "integer"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 0}', 400, "max_tokens", "max_tokens"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 100000000}', 400, "max_tokens", "at most"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": -1}', 400, "temperature", "temperature"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": "hot"}', 400, "temperature", "number"),
    ("/v1/completions", b'{"prompt": "hi", "top_p": 0}', 400, "top_p", "top_p"),
    ("/v1/completions", b'{"prompt": "hi", "n": 0}', 400, "n", "n must be"),
    ("/v1/completions", b'{"prompt": "hi", "stop": [""]}', 400, "stop", "stop"),
    ("/v1/completions", b'{"prompt": "hi", "logprobs": 99}', 400, "logprobs", "logprobs"),
    ("/v1/completions", b'{"prompt": "hi", "stream": "yes"}', 400, "stream", "boolean"),
    ("/v1/completions", b'{"prompt": ""}', 400, "prompt", "empty"),
    ("/v1/completions", b'{"prompt": []}', 400, "prompt", "empty"),
    ("/v1/completions", b'{"prompt": [1, -5]}', 400, "prompt", "token ids"),
    ("/v1/completions", b'{"prompt": "hi", "model": "gpt-4"}', 404, "model", "does not exist"),
    ("/v1/completions", b'{"prompt": "hi", "frequency_penalty": 2.5}', 400, "frequency_penalty", "must be in [-2, 2]"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}', 400,
     "tool_choice", "needs tools"),
    ("/v1/chat/completions", b'{"messages": []}', 400, "messages", "non-empty"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user"}], "max_tokens": 2}', 400, "messages.0", "not null or missing"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": null}]}', 400, "messages.0", "not null"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "guided_json": {"type": "object"}}',
     400, "guided_json", "not supported"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "temprature": 0}', 400, "temprature",
     "unknown field"),
    ("/v1/completions", b'{"prompt": "hi", "best_off": 2}', 400, "best_off", "unknown field"),
    ("/v1/completions", b'{"prompt": "hi", "min_p": 1.5}', 400, "min_p", "min_p must be in [0, 1]"),
    ("/v1/completions", b'{"prompt": "hi", "min_p": 0.1, "max_tokens": 2, "user": "u1"}', 200, None, ""),
    ("/v1/chat/completions", b'{"messages": [{"content": "hi"}]}', 400, "messages.0.role", "Field required"),
    ("/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "hi"}]}', 400, "messages.0.role", "wizard"),
    ("/v1/chat/completions", b'{"messages": "hello"}', 400, "messages", "list"),
    ("/tokenize", b'{}', 400, "prompt", "exactly one"),
    ("/detokenize", b'{"tokens": [999999999]}', 400, "tokens", "token ids"),
]


@pytest.mark.parametrize("path,body,status,param,words", BAD)
def test_bad_request_gets_clear_error(server, path, body, status, param, words):
    r = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == status, r.text
    if status == 200:
        return
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and words in err["message"], err
    assert httpx.get(server.url + "/health").status_code == 200


def test_prompt_that_does_not_fit(client, model_name, server):
    too_long = list(range(100, 100 + server.engine.max_model_len))
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_name, prompt=too_long, max_tokens=1)
    assert e.value.code == "context_length_exceeded" and "max_model_len" in e.value.message


def test_unknown_model_and_route(client, server):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=1)
    assert e.value.code == "model_not_found"
    r = httpx.get(server.url + "/v2/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_server_keeps_serving_after_errors(client, model_name):
    for _ in range(2):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=model_name, prompt="hi", max_tokens=-3)
    r = client.completions.create(model=model_name, prompt="hi", max_tokens=2, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")


def test_too_large_body_gets_413(server):
    body = b'{"prompt": "' + b"a" * (5 << 20) + b'"}'
    r = httpx.post(server.url + "/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and "at most" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/health").status_code == 200


def test_a_prompt_past_a_capped_max_model_len_says_why(smol_loaded):
    from conftest import ServerThread, make_engine

    with ServerThread(make_engine(smol_loaded, kv_cache_memory=16 << 20, max_model_len=None)) as s:
        r = httpx.post(s.url + "/v1/completions", json={"prompt": list(range(100, 500)), "max_tokens": 1}, timeout=60)
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded"
    assert "max_model_len is 352 (capped from the model's context of 8,192 tokens so that one sequence fits the KV " \
           "budget of 16 MiB" in err["message"]
