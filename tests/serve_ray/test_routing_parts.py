"""The parts of the Ray deployment that need no Ray: routing keys, chunk hashes, merged metrics, CLI and install hint,
the router's decisions and a replica's handle in this process."""
from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest

from kvforge.errors import ConfigError
from kvforge.serve_ray.metrics import merge
from kvforge.serve_ray.prefix_keys import CHUNK_CHARS, CHUNK_TOKENS, ChunkSet, chunk_hashes, matched_chunks, routing_key


def test_routing_key_reads_prompts_and_messages():
    body = json.dumps({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]})
    assert routing_key("/v1/chat/completions", body.encode()) == "<system>be brief<user>hi"
    assert routing_key("/v1/completions", b'{"prompt": [5, 6, 7]}') == [5, 6, 7]
    assert routing_key("/v1/completions", b'{"prompt": ["first", "second"]}') == "first"
    assert routing_key("/v1/models", b"") is None
    assert routing_key("/v1/completions", b"not json") is None


def test_chunk_hashes_chain_and_cut_whole_chunks():
    shared = "s" * (3 * CHUNK_CHARS)
    a, b = chunk_hashes(shared + "a" * CHUNK_CHARS), chunk_hashes(shared + "b" * CHUNK_CHARS)
    assert len(a) == 4 and a[:3] == b[:3] and a[3] != b[3]
    assert chunk_hashes("x" * (CHUNK_CHARS - 1)) == []
    assert chunk_hashes("ab" + shared)[0] != a[0], "a chunk's hash depends on everything before it"
    ids = list(range(2 * CHUNK_TOKENS + 5))
    assert len(chunk_hashes(ids)) == 2 and chunk_hashes(ids) == chunk_hashes(ids[:2 * CHUNK_TOKENS])


def test_chunk_set_is_lru_bounded_and_matches_leading_chunks():
    held = ChunkSet(capacity=3)
    held.add(["h1", "h2", "h3"])
    held.add(["h1", "h4"])  # h1 touched, h2 evicted
    assert len(held) == 3 and "h2" not in held and held.newest(2) == ["h1", "h4"]
    assert matched_chunks(["h1", "h3", "h2", "h4"], held) == 2
    assert matched_chunks(["h2", "h1"], held) == 0
    assert matched_chunks(["h2", "h1"], held, {"h2"}) == 2


def test_merge_labels_each_replica_and_keeps_one_header_per_family():
    text = ("# HELP kvforge_kv_usage_ratio u\n# TYPE kvforge_kv_usage_ratio gauge\nkvforge_kv_usage_ratio 0.5\n"
            "# HELP kvforge_requests_finished_total f\n# TYPE kvforge_requests_finished_total counter\n"
            'kvforge_requests_finished_total{reason="stop"} 3\n')
    out = merge({"r1": text, "r2": text.replace("0.5", "0.25")}, Counter({("prefix", "prefix_match"): 7}))
    assert out.count("# TYPE kvforge_kv_usage_ratio gauge") == 1
    assert 'kvforge_kv_usage_ratio{replica="r1"} 0.5' in out and 'kvforge_kv_usage_ratio{replica="r2"} 0.25' in out
    assert 'kvforge_requests_finished_total{replica="r2",reason="stop"} 3' in out
    assert 'kvforge_router_decisions_total{policy="prefix",decision="prefix_match"} 7' in out
    assert "kvforge_replicas 2" in out


def test_without_ray_the_flag_says_how_to_install(monkeypatch):
    from kvforge.serve_ray import require_ray

    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ConfigError, match=r"pip install 'kvforge\[ray\]'"):
        require_ray()


def test_serve_ray_cli_options():
    from kvforge.cli import build_parser
    from kvforge.serve_ray.launcher import RayDeployment, parse_autoscale

    args = build_parser().parse_args(["serve", "--ray", "--autoscale", "1:4", "--routing", "pow2", "--ray-address",
                                      "ray://head:10001", "--kv-dtype", "int8"])
    assert (args.ray, args.autoscale, args.routing, args.ray_address, args.kv_dtype) == (
        True, "1:4", "pow2", "ray://head:10001", "int8")
    assert parse_autoscale("1:4") == (1, 4)
    for bad in ("4", "a:b", "3:1"):
        with pytest.raises(ConfigError, match="autoscale"):
            RayDeployment({}, autoscale=parse_autoscale(bad))
    with pytest.raises(ConfigError, match="routing"):
        RayDeployment({}, routing="round-robin")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--ray", "--num-replicas", "2", "--autoscale", "1:2"])


class FakeReplica:
    def __init__(self, name: str, stats: dict | None = None):
        self.replica_id, self.routing_stats = name, stats or {}


class FakeRequest:
    def __init__(self, rid: str, key):
        from types import SimpleNamespace

        self.args, self.metadata = ["POST", "/v1/completions", "", [], b"", key], SimpleNamespace(internal_request_id=rid)


def _router(**kwargs):
    pytest.importorskip("ray.serve.request_router")
    from kvforge.serve_ray.router import PrefixAffinityRouter

    router = PrefixAffinityRouter.__new__(PrefixAffinityRouter)  # the decision logic only; Ray wires the rest
    router.initialize_state(**kwargs)
    return router


def _choose(router, replicas, rid: str, key) -> str:
    import asyncio

    request = FakeRequest(rid, key)
    ranks = asyncio.run(router.choose_replicas(replicas, request))
    router.on_request_routed(request, ranks[0][0].replica_id, None)
    return ranks[0][0].replica_id


def test_prefix_router_spreads_new_prompts_then_sticks_and_falls_back_when_imbalanced():
    router = _router(imbalance=3)
    replicas = [FakeReplica("r1"), FakeReplica("r2")]
    systems = [c * (4 * CHUNK_CHARS) for c in "abcd"]
    homes = [_choose(router, replicas, f"w{i}", s + "?") for i, s in enumerate(systems)]
    assert sorted(homes) == ["r1", "r1", "r2", "r2"], "new prompts go to the least-loaded replica"
    for q in range(3):
        for i, s in enumerate(systems):
            assert _choose(router, replicas, f"q{q}-{i}", s + f"question {q}") == homes[i]
    busy, idle = homes[0], next(r for r in ("r1", "r2") if r != homes[0])
    for q in range(4):  # nothing completes: the home of systems[0] gets 4 more in flight than the other replica
        _choose(router, replicas, f"load{q}", systems[0] + f"again {q}")
    assert _choose(router, replicas, "over", systems[0] + "one more") == idle
    before = router._in_flight[busy]
    router.on_request_completed(busy, "any")
    assert router._in_flight[busy] == before - 1 == 12 - 1


def test_prefix_router_uses_what_replicas_report():
    router = _router()
    system = "z" * (4 * CHUNK_CHARS)
    reported = FakeReplica("r2", {"prefix_chunks": chunk_hashes(system), "kv_usage": 0.9})
    assert _choose(router, [FakeReplica("r1"), reported], "x", system + "tail") == "r2"
    assert _choose(router, [FakeReplica("r1"), reported], "y", "unrelated " * 40) == "r1", "no match: least loaded"


NOT_TOKEN_IDS = [[2**31] * 20, [2**64] * 20, [-1] * 20, [True] * 20, [1.5] * 20, [[2**40] * 20], [3] * 16 + ["a"]]
ODD_BODIES = [
    b"[" * 100_000,  # nested too deep for json
    json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}).encode(),
    json.dumps({"messages": [{"role": "user", "content": {"text": "x"}}, 7, None]}).encode(),
    json.dumps({"prompt": "\ud800" * (2 * CHUNK_CHARS)}).encode(),  # lone surrogates: valid JSON, not UTF-8 text
    json.dumps({"messages": [{"role": "user", "content": "\udfff" * (2 * CHUNK_CHARS)}]}).encode(),
]


@pytest.mark.parametrize("body", [json.dumps({"prompt": ids}).encode() for ids in NOT_TOKEN_IDS] + ODD_BODIES)
def test_routing_never_raises_on_bodies_the_app_refuses(body):
    """Such a request is routed anywhere (no key, or chunks of its text), and the app's validation answers it."""
    for path in ("/v1/completions", "/v1/chat/completions"):
        key = routing_key(path, body)
        assert key is None or isinstance(key, str)
        chunk_hashes(key or "")


@pytest.mark.parametrize("ids", NOT_TOKEN_IDS)
def test_a_list_that_is_not_token_ids_has_no_chunks_and_no_route(ids):
    assert chunk_hashes(ids) == [] and routing_key("/v1/completions", json.dumps({"prompt": ids}).encode()) is None
    router = _router()
    assert _choose(router, [FakeReplica("r1"), FakeReplica("r2")], "x", ids) in ("r1", "r2")


def test_a_refused_request_is_forgotten_by_the_router():
    router = _router()
    system = "y" * (4 * CHUNK_CHARS)
    home = _choose(router, [FakeReplica("r1"), FakeReplica("r2")], "x", system + "?")
    assert router._matched(FakeReplica(home), chunk_hashes(system)) == 4
    router.forget("not-" + home, chunk_hashes(system))
    assert router._matched(FakeReplica(home), chunk_hashes(system)) == 4
    router.forget(home, chunk_hashes(system + "?"))
    assert router._matched(FakeReplica(home), chunk_hashes(system)) == 0


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    """A replica in this process (no Ray): the engine and the app of `kvforge serve` behind its handle."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "server"))  # faults.py
    from faults import write_tiny_char_model

    from kvforge.serve_ray.replica import KVForgeReplica
    from kvforge.server import ServerConfig

    model = tmp_path_factory.mktemp("tiny-char-replica")
    write_tiny_char_model(model)
    engine = {"model": str(model), "kv_cache_memory": 8 << 20, "max_model_len": 512}
    replica = KVForgeReplica(engine, ServerConfig(api_keys=["key-a"]))
    yield replica
    replica.loop.stop()


def _handle(replica, body: dict, headers: list[tuple[str, str]]) -> int:
    import asyncio

    raw = json.dumps(body).encode()
    key = routing_key("/v1/completions", raw)

    async def status() -> int:
        items = [item async for item in replica.handle("POST", "/v1/completions", "", headers, raw, key)]
        return items[0][0]

    return asyncio.run(status())


def test_replica_records_chunks_only_for_requests_its_app_accepted(replica):
    auth = [("authorization", "Bearer key-a"), ("content-type", "application/json")]
    prompt = "Routing state for accepted requests only: " * 4  # a few whole chunks
    refused = [({"prompt": prompt, "max_tokens": 2}, [("content-type", "application/json")], 401),
               ({"prompt": prompt, "max_tokens": 2, "temperature": -1}, auth, 400),
               ({"prompt": [500] * (2 * CHUNK_TOKENS), "max_tokens": 2}, auth, 400)]  # ids past the vocabulary
    for body, headers, want in refused:
        assert _handle(replica, body, headers) == want
    assert len(replica.served) == 0
    assert _handle(replica, {"prompt": prompt, "max_tokens": 2}, auth) == 200
    assert replica.served.newest(100) == chunk_hashes(prompt)
