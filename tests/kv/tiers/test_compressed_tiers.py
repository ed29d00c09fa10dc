"""Compressed prompts in the KV tiers (kvzip with reuse): a context compressed once is stored in a disk, host or Redis
tier under a key naming the model, format, salt, tokens, method and budget; a fresh engine on the same disk directory,
an engine whose in-memory entry gave way (host), and a second process (Redis) adopt it with no scoring pass and
answer the same greedy tokens as the engine that compressed it and as recompressing the context. Another budget,
option, KV format or salt misses; a corrupt entry is recompressed; an abort while loading leaks no block."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from kvzip_reference import recompressed

from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.kv.tiers.disk import SUFFIX
from kvforge.sampling_params import SamplingParams

g = torch.Generator().manual_seed(5)
CONTEXT = [int(t) for t in torch.randint(1, 90, (120,), generator=g)]
QUESTIONS = [[int(t) for t in torch.randint(1, 90, (4,), generator=g)] for _ in range(3)]
OPTIONS = {"budget": 0.5, "repeat_prompt": [7, 8, 9, 10], "chunk": 32, "reuse": True}
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

SECOND_PROCESS = """
import json, sys, torch
from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.models.loader import load_model
from kvforge.sampling_params import SamplingParams
model_dir, url, options, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
loaded = load_model(model_dir)
with torch.no_grad():
    for layer in loaded.model.model.layers:
        layer.self_attn.q_proj.weight.mul_(30.0)  # tests/conftest.py's peaky_loaded
e = LLMEngine(EngineConfig(kv_cache_memory=4_000_000, block_size=8, kv_policy="kvzip", kv_policy_options=options,
                           kv_tiers=[url]), loaded)
answers = []
for p in prompts:
    rid = e.add_request(p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    while e.has_unfinished_requests():
        answers += [o.token_ids for o in e.step() if o.finished and o.request_id == rid]
s = e.stats()
e.close()
print(json.dumps({"answers": answers, "compactions": s["kv_compactions"], "hits": s["compressed_prefix_tier_hits"]}))
"""


def _engine(loaded, tiers=None, config=None, **options) -> LLMEngine:
    return LLMEngine(EngineConfig(kv_cache_memory=4_000_000, block_size=8, kv_policy="kvzip",
                                  kv_policy_options={**OPTIONS, **options}, kv_tiers=tiers, **(config or {})), loaded)


def _ask(engine, prompt, salt: str | None = None) -> list[int]:
    rid = engine.add_request(prompt, GREEDY, cache_salt=salt)
    out = None
    while engine.has_unfinished_requests():
        out = next((o for o in engine.step() if o.finished and o.request_id == rid), out)
    return list(out.token_ids)


def _answers_in_memory(loaded) -> list[list[int]]:
    engine = _engine(loaded)
    _ask(engine, CONTEXT)
    answers = [_ask(engine, CONTEXT + q) for q in QUESTIONS]
    assert engine.stats()["kv_compactions"] == 1
    return answers


def _no_leak(engine) -> None:
    engine.kv.reset_prefix_cache()
    assert engine.kv.allocator.num_used == 0
    engine.kv.allocator.check()


def test_a_fresh_engine_on_the_disk_adopts_the_compressed_context(peaky_loaded, tmp_path):
    disk = [f"disk:{tmp_path}:64MiB"]
    first = _engine(peaky_loaded, disk)
    _ask(first, CONTEXT)
    s = first.stats()
    assert s["compressed_prefixes_to_tiers"] == 1 and s["kv_compactions"] == 1
    first.close()
    assert len([f for f in os.listdir(tmp_path) if f.endswith(SUFFIX)]) == 1

    second = _engine(peaky_loaded, disk)
    answers = [_ask(second, CONTEXT + q) for q in QUESTIONS]
    assert answers == _answers_in_memory(peaky_loaded)
    rows = second.stats()["compressed_prefix_blocks"] * 8
    reference = _engine(peaky_loaded, budget=rows, reuse=False)  # as many rows, kvzip's next best to the block edge
    assert answers == [recompressed(reference, CONTEXT, q, GREEDY.max_tokens)[0] for q in QUESTIONS]
    s = second.stats()
    assert s["kv_compactions"] == 0  # no scoring pass: the context came compressed from the disk
    assert s["compressed_prefix_tier_hits"] == 1  # the first question loaded it; the others found it in memory
    assert s["compressed_prefix_tier_hit_tokens"] == len(CONTEXT)
    assert s["prefix_hit_tokens"] == len(QUESTIONS) * len(CONTEXT)
    assert s["compressed_prefixes_to_tiers"] == 0  # what came from a tier is not stored again
    _no_leak(second)
    second.close()


def test_an_engine_beside_finds_what_the_other_wrote_after_it_opened(peaky_loaded, tmp_path):
    disk = [f"disk:{tmp_path}:64MiB"]
    beside = _engine(peaky_loaded, disk)  # indexed the directory while it was empty
    first = _engine(peaky_loaded, disk)
    _ask(first, CONTEXT)
    first.close()
    assert _ask(beside, CONTEXT + QUESTIONS[0]) == _answers_in_memory(peaky_loaded)[0]
    assert beside.stats()["compressed_prefix_tier_hits"] == 1 and beside.stats()["kv_compactions"] == 0
    beside.close()


def test_close_writes_them_to_a_write_back_disk(peaky_loaded, tmp_path):
    disk = [f"disk:{tmp_path}:64MiB"]
    first = LLMEngine(EngineConfig(kv_cache_memory=4_000_000, block_size=8, kv_policy="kvzip", kv_policy_options=OPTIONS,
                                   kv_tiers=disk, kv_tier_write_through=False), peaky_loaded)
    _ask(first, CONTEXT)
    assert first.stats()["compressed_prefixes_to_tiers"] == 0  # write-back: nothing yet
    first.close()
    assert first.stats()["tier_close_queued_blocks"] == 1
    second = _engine(peaky_loaded, disk)
    assert _ask(second, CONTEXT + QUESTIONS[0]) == _answers_in_memory(peaky_loaded)[0]
    assert second.stats()["compressed_prefix_tier_hits"] == 1 and second.stats()["kv_compactions"] == 0
    second.close()


def test_another_budget_option_format_or_salt_misses(peaky_loaded, tmp_path):
    disk = [f"disk:{tmp_path}:64MiB"]
    first = _engine(peaky_loaded, disk)
    _ask(first, CONTEXT)
    first.close()
    for config, options, salt in (({}, {"budget": 0.25}, None), ({}, {"chunk": 16}, None),
                                  ({"kv_cache_dtype": "int8"}, {}, None), ({}, {}, "tenant")):
        other = _engine(peaky_loaded, disk, config, **options)
        _ask(other, CONTEXT + QUESTIONS[0], salt)
        s = other.stats()
        assert s["compressed_prefix_tier_hits"] == 0 and s["prefix_hit_tokens"] == 0
        assert s["kv_compactions"] == 1  # scored and compressed itself
        _no_leak(other)
        other.close()
    same = _engine(peaky_loaded, disk)  # the entry is there for the budget and method it names
    _ask(same, CONTEXT + QUESTIONS[0])
    assert same.stats()["compressed_prefix_tier_hits"] == 1 and same.stats()["kv_compactions"] == 0
    same.close()


def test_a_host_tier_keeps_what_memory_gave_way(peaky_loaded):
    engine = _engine(peaky_loaded, ["host:64MiB"])
    _ask(engine, CONTEXT)
    assert engine.stats()["compressed_prefixes_to_tiers"] == 0  # host is write-back: nothing stored yet
    assert engine.kv.reset_prefix_cache() > 0  # the in-memory entry gives way: written back to the host tier
    assert engine.stats()["compressed_prefixes_to_tiers"] == 1
    assert [_ask(engine, CONTEXT + q) for q in QUESTIONS] == _answers_in_memory(peaky_loaded)
    s = engine.stats()
    assert s["kv_compactions"] == 1 and s["compressed_prefix_tier_hits"] == 1
    _no_leak(engine)
    engine.close()


def _stored_on_disk(loaded, directory) -> list[str]:
    """A disk tier at `directory` holding CONTEXT compressed by an engine that has closed."""
    disk = [f"disk:{directory}:64MiB"]
    first = _engine(loaded, disk)
    _ask(first, CONTEXT)
    first.close()
    return disk


def test_a_corrupt_entry_is_recompressed(peaky_loaded, tmp_path):
    disk = _stored_on_disk(peaky_loaded, tmp_path)
    (entry,) = [tmp_path / f for f in os.listdir(tmp_path) if f.endswith(SUFFIX)]
    entry.write_bytes(entry.read_bytes()[:-100])  # truncated
    second = _engine(peaky_loaded, disk)
    assert _ask(second, CONTEXT + QUESTIONS[0]) == _answers_in_memory(peaky_loaded)[0]
    s = second.stats()
    assert s["compressed_prefix_tier_hits"] == 0 and s["kv_compactions"] == 1
    _no_leak(second)
    second.close()


def test_an_abort_while_loading_frees_every_block(peaky_loaded, tmp_path):
    disk = _stored_on_disk(peaky_loaded, tmp_path)
    second = _engine(peaky_loaded, disk)
    rid = second.add_request(CONTEXT + QUESTIONS[0], GREEDY)
    second.step()  # admission: the load starts, the request waits for it
    assert second.kv.is_loading(second.requests[rid])
    second.abort(rid)
    while second.has_unfinished_requests():
        second.step()
    assert second.kv.allocator.num_used == 0 and not second.kv.requests
    second.kv.allocator.check()
    assert _ask(second, CONTEXT + QUESTIONS[1]) == _answers_in_memory(peaky_loaded)[1]  # still served from the disk
    _no_leak(second)
    second.close()


def test_a_second_process_adopts_it_from_redis(peaky_loaded, tiny_dir, redis_url):
    first = _engine(peaky_loaded, [redis_url], budget=0.5)
    _ask(first, CONTEXT)
    first.close()
    prompts = [CONTEXT + q for q in QUESTIONS]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", SECOND_PROCESS, tiny_dir, redis_url, json.dumps(OPTIONS),
                          json.dumps(prompts)], check=False, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["answers"] == _answers_in_memory(peaky_loaded)
    assert got["compactions"] == 0 and got["hits"] == 1
