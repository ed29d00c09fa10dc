"""API keys (401), per-key prefix-cache isolation, and 429 when the waiting queue is full."""
import asyncio

import httpx
import openai
import pytest
from conftest import ServerThread, make_engine

from kvforge.server import ServerConfig

# long enough to fill whole 16-token blocks, so a repeat can hit the prefix cache
PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman who went out every morning"


def cached_tokens(url: str, key: str) -> int:
    with openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0) as c:
        r = c.completions.create(model="m", prompt=PROMPT, max_tokens=1, temperature=0)
        return r.usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize("share", [False, True])
def test_keys_and_tenant_isolation(smol_loaded, share):
    config = ServerConfig(api_keys=["key-a", "key-b"], share_prefix_cache_across_keys=share, served_model_name="m")
    with ServerThread(make_engine(smol_loaded), config) as s:
        for key in ("key-c", "key-a-suffix", "KEY-A"):
            with pytest.raises(openai.AuthenticationError), openai.OpenAI(base_url=s.url + "/v1", api_key=key,
                                                                          max_retries=0) as c:
                c.models.list()
        assert httpx.post(s.url + "/v1/completions", json={"prompt": "hi"}).status_code == 401
        assert httpx.get(s.url + "/health").status_code == 200
        assert cached_tokens(s.url, "key-a") == 0
        assert cached_tokens(s.url, "key-a") > 0, "a repeat by the same key hits its own cache"
        b = cached_tokens(s.url, "key-b")
        assert (b > 0) if share else (b == 0)


def test_full_waiting_queue_gets_429(smol_loaded):
    engine = make_engine(smol_loaded, max_num_seqs=1)
    with ServerThread(engine, ServerConfig(max_waiting=1)) as s:
        async def one(client: httpx.AsyncClient) -> int:
            r = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0})
            if r.status_code == 429:
                assert r.json()["error"]["code"] == "rate_limit_exceeded"
            return r.status_code

        async def burst() -> list[int]:
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as client:
                return await asyncio.gather(*(one(client) for _ in range(6)))

        codes = asyncio.run(burst())
        assert set(codes) == {200, 429}, codes
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "n": 2, "max_tokens": 1})
        assert r.status_code == 429, "a request larger than the whole queue is refused"
        assert "kvforge_requests_rejected_total" in httpx.get(s.url + "/metrics").text


def test_serve_cli_options():
    from kvforge.cli import build_parser

    args = build_parser().parse_args(["serve", "--port", "9001", "--api-key", "a", "--api-key", "b", "--max-waiting", "8",
                                      "--share-prefix-cache-across-keys", "--kv-memory", "64MiB"])
    assert (args.port, args.api_key, args.max_waiting, args.share_prefix_cache_across_keys) == (9001, ["a", "b"], 8, True)
    assert args.func.__module__ == "kvforge.cli.serve"
