"""Request bounds answer 400s that name the parameter and the allowed range (413 for the body); API keys compare in
constant time."""
import httpx
import pytest
from conftest import ServerThread

import kvforge.server.app as app_module
from kvforge.server import ServerConfig
from kvforge.server.app import KeyChecker
from kvforge.server.limits import RequestLimits

LIMITS = RequestLimits(max_body_bytes=4000, max_tokens=8)


@pytest.fixture(scope="module")
def url(char_dir):
    from kvforge.config import EngineConfig
    from kvforge.engine.engine import LLMEngine
    from kvforge.models.loader import load_model

    engine = LLMEngine(EngineConfig(kv_cache_memory=8 << 20, max_model_len=512), load_model(char_dir))
    with ServerThread(engine, ServerConfig(limits=LIMITS)) as s:
        yield s.url


TOO_MUCH = [
    # (path, extra fields, param, words in the message)
    ("/v1/completions", {"n": 17}, "n", "1..16"),
    ("/v1/completions", {"prompt": ["a"] * 5, "n": 16}, "n", "at most 64"),
    ("/v1/completions", {"logprobs": 21}, "logprobs", "0..20"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "0..20"),
    ("/v1/completions", {"stop": [f"s{i}" for i in range(17)]}, "stop", "at most 16"),
    ("/v1/completions", {"stop": ["x" * 257]}, "stop", "1..256"),
    ("/v1/completions", {"max_tokens": 9}, "max_tokens", "1..8"),
    ("/v1/chat/completions", {"max_completion_tokens": 9}, "max_completion_tokens", "1..8"),
]


@pytest.mark.parametrize("path,extra,param,words", TOO_MUCH)
def test_each_bound_is_a_400_naming_its_limit(url, path, extra, param, words):
    body = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi!"}
    body = {**body, **extra}  # unknown fields are refused: each endpoint gets its own
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_default_max_tokens_is_the_server_limit(url):
    r = httpx.post(url + "/v1/completions", json={"prompt": "hi!", "ignore_eos": True, "temperature": 0}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == LIMITS.max_tokens


@pytest.mark.parametrize("chunked", [False, True])
def test_body_over_the_limit_is_refused_while_reading(url, chunked):
    body = b'{"prompt": "' + b"x" * 5000 + b'"}'
    content = iter([body[:3000], body[3000:]]) if chunked else body  # chunked: no Content-Length to trust
    r = httpx.post(url + "/v1/completions", content=content, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and "at most 4000 bytes" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["code"] == "request_too_large"
    assert httpx.post(url + "/v1/completions", json={"prompt": "ok", "max_tokens": 2}, timeout=60).status_code == 200


def test_json_nested_too_deeply_is_a_400(url):
    r = httpx.post(url + "/v1/completions", content=b"[" * 3000, headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 400 and "too deeply" in r.json()["error"]["message"], r.text


def test_api_keys_compare_every_key_on_equal_length_digests(monkeypatch):
    calls = []
    compare = app_module.hmac.compare_digest

    def counted(a, b):
        calls.append((len(a), len(b)))
        return compare(a, b)

    monkeypatch.setattr(app_module.hmac, "compare_digest", counted)
    keys = KeyChecker(["first-key", "second", "a-much-longer-third-key"])
    for candidate, ok in [("first-key", True), ("a-much-longer-third-key", True), ("second!", False), ("", False),
                          ("x" * 500, False)]:
        calls.clear()
        assert keys.matches(candidate) is ok
        assert calls == [(32, 32)] * 3, candidate  # no early exit on a match, nothing that depends on the length


def test_prompt_room_is_the_engines_own_length_limit(char_engine):
    """Under StreamingLLM the engine runs past max_model_len (bounded cache); the server must not refuse it."""
    engine = char_engine(kv_policy="streaming", kv_policy_options={"budget": 64, "sinks": 4}, max_model_len=128)
    assert engine.length_limit > engine.max_model_len
    with ServerThread(engine) as s:
        body = {"prompt": "abcdefgh" * 40, "max_tokens": 200, "ignore_eos": True}  # 320 + 200 tokens > 128
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"] == {"prompt_tokens": 320, "completion_tokens": 200, "total_tokens": 520,
                                     "prompt_tokens_details": {"cached_tokens": 0}}
