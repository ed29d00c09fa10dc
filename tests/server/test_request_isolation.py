"""Over HTTP, one client's degenerate parameters get that client a 400 (or greedy output), and one client's slow
tokenization blocks nobody: a stream running beside them still gets its full normal response."""
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import ServerThread

PROMPT, OTHER = "The cat sat on the mat.", "Once upon a time"
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(char_dir):
    from kvforge.config import EngineConfig
    from kvforge.engine.engine import LLMEngine
    from kvforge.models.loader import load_model

    engine = LLMEngine(EngineConfig(kv_cache_memory=8 << 20, max_model_len=512), load_model(char_dir))
    with ServerThread(engine) as s:
        yield s


@pytest.fixture(scope="module")
def url(server) -> str:
    return server.url


def complete(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, **body}, timeout=60)


def streamed_text(lines) -> str:
    text = ""
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            text += chunk["choices"][0]["text"] or ""
    return text


BAD = [
    ({"repetition_penalty": 1e-39}, "repetition_penalty", "[0.01, 100.0]"),
    ({"repetition_penalty": 1e39}, "repetition_penalty", "[0.01, 100.0]"),
    ({"seed": 2**64, "temperature": 1.0}, "seed", "18446744073709551615"),
    ({"seed": -(2**63) - 1, "temperature": 1.0}, "seed", "-9223372036854775808"),
    ({"seed": 2**64 - 1, "n": 2, "temperature": 1.0}, "seed", "at most 2**64 - n"),
]


def test_degenerate_parameters_beside_a_running_stream(url):
    want = complete(url, prompt=OTHER, max_tokens=300, **GREEDY).json()["choices"][0]["text"]
    greedy = complete(url, **GREEDY).json()["choices"][0]["text"]
    body = {"prompt": OTHER, "max_tokens": 300, "stream": True, **GREEDY}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as other:
        lines = other.iter_lines()
        first = next(lines)  # the other stream is running: what follows shares its steps
        tiny = complete(url, temperature=1e-39, ignore_eos=True)
        assert tiny.status_code == 200 and tiny.json()["choices"][0]["text"] == greedy  # below 1e-5: greedy
        for extra, param, words in BAD:
            r = complete(url, **extra)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == param and words in err["message"], err
        assert streamed_text([first, *lines]) == want


@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize"])
def test_a_lone_surrogate_in_the_prompt_is_a_400(url, path):
    """JSON may escape half of a UTF-16 pair ("\\ud800"); that is no Unicode text, and the tokenizer cannot take it."""
    raw = json.dumps({"prompt": "ab\ud800cd", **({"max_tokens": 2} if "completions" in path else {})}).encode()
    r = httpx.post(url + path, content=raw, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt" and "unpaired UTF-16 surrogate" in err["message"], err


@pytest.mark.parametrize("path, body", [("/v1/completions", {"max_tokens": 4}), ("/tokenize", {})])
def test_a_slow_tokenization_does_not_stall_another_stream(server, monkeypatch, path, body):
    """The slow prompt's encode blocks until the other stream has finished: that can only happen when tokenizing
    runs off the event loop (before, the other request was never read and the client timed out)."""
    url, tokenizer = server.url, server.engine.tokenizer
    want = complete(url, prompt=OTHER, max_tokens=40, **GREEDY).json()["choices"][0]["text"]
    encode, entered, release = tokenizer.encode, threading.Event(), threading.Event()
    slow_prompt = "a prompt that takes the tokenizer a long time"

    def slow_encode(text, *args, **kwargs):
        if text == slow_prompt:
            entered.set()
            release.wait(60)
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", slow_encode)
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(httpx.post, url + path, json={"prompt": slow_prompt, **body}, timeout=60)
        try:
            assert entered.wait(60)
            stream = {"prompt": OTHER, "max_tokens": 40, "stream": True, **GREEDY}
            with httpx.stream("POST", url + "/v1/completions", json=stream, timeout=20) as other:
                assert streamed_text(other.iter_lines()) == want
        finally:
            release.set()
        assert slow.result().status_code == 200, slow.result().text
