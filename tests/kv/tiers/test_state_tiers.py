"""Recurrent state checkpoints in the KV tiers: a Granite-hybrid's or Mamba2's prefix comes back from host, disk or
Redis with its state checkpoint, so a request resumes from the deepest block that has both its KV and a checkpoint
in the pool or any tier; tokens equal those of an engine without tiers or prefix caching. A second engine (disk) and
a second process (Redis) reuse what the first computed; a checkpoint missing from the tier resumes from a shallower
one (counted), never wrong; nothing leaks."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from tiny_models import write_tiny_model

from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.kv.tiers.disk import SUFFIX
from kvforge.models.loader import load_model
from kvforge.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
BASE = torch.randint(0, 96, (120,), generator=torch.Generator().manual_seed(7)).tolist()
OTHER = torch.randint(0, 96, (60,), generator=torch.Generator().manual_seed(8)).tolist()
PROMPTS = [BASE[:70], BASE[:100], BASE[:40] + OTHER[:30], OTHER]
HERE = os.path.dirname(__file__)

SECOND_PROCESS = """
import json, sys
from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.models.loader import load_model
from kvforge.sampling_params import SamplingParams
model_dir, url, prompt = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
e = LLMEngine(EngineConfig(kv_cache_memory=4 << 20, max_num_seqs=4, max_num_batched_tokens=64, kv_tiers=[url]),
              load_model(model_dir))
rid = e.add_request(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
out = None
while e.has_unfinished_requests():
    out = next((o for o in e.step() if o.request_id == rid and o.finished), out)
e.close()
print(json.dumps({"tokens": out.token_ids, "cached": out.metrics.cached_tokens}))
"""


@pytest.fixture(scope="module", params=["granite-hybrid", "mamba2"])
def model(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    write_tiny_model(request.param, d)
    return load_model(str(d)), str(d)


def _engine(loaded, **options) -> LLMEngine:
    return LLMEngine(EngineConfig(kv_cache_memory=4 << 20, max_num_seqs=4, max_num_batched_tokens=64, **options), loaded)


def _run(engine, prompt, salt: str | None = None) -> tuple[list[int], int]:
    rid = engine.add_request(prompt, GREEDY, cache_salt=salt)
    out = None
    while engine.has_unfinished_requests():
        out = next((o for o in engine.step() if o.request_id == rid and o.finished), out)
    return out.token_ids, out.metrics.cached_tokens


def _plain(loaded) -> dict[int, list[int]]:
    plain = _engine(loaded, enable_prefix_caching=False)
    return {i: _run(plain, p)[0] for i, p in enumerate(PROMPTS + [BASE[:80]])}


def _assert_nothing_left(engine) -> None:
    kv = engine.kv
    assert kv.allocator.num_used == kv.prefix_tree.cached_blocks
    assert kv.state_pool.num_free == kv.state_pool.num_slots and not kv.requests


@pytest.mark.parametrize("tier", ["host:16MiB", "disk"])
def test_tiers_on_and_off_give_the_same_tokens(model, tier, tmp_path):
    """Each prompt runs, the pool's prefix cache is reset (blocks and checkpoints go to the write-back host tier;
    disk got them when they were made), and it runs again: the second run's prefix comes from the tier."""
    loaded, _ = model
    want = _plain(loaded)
    engine = _engine(loaded, kv_tiers=[tier if tier != "disk" else f"disk:{tmp_path}:64MiB"])
    hits = []
    for i, prompt in enumerate(PROMPTS):
        first, hit_first = _run(engine, prompt)
        engine.kv.reset_prefix_cache()
        again, hit = _run(engine, prompt)
        assert first == again == want[i], i
        hits.append((hit_first, hit))
        engine.kv.reset_prefix_cache()
    # again: each prompt's last whole block; first: what the earlier prompts left in the tier (BASE[:64], [:32])
    assert hits == [(0, 64), (64, 96), (32, 64), (0, 48)]
    s = engine.stats()
    assert s["state_checkpoints_from_tiers"] == 6 and s["tier_hit_tokens"] == sum(map(sum, hits))
    assert s["state_checkpoints_to_tiers"] >= s["state_checkpoints_stored"] > 0
    assert s["prefix_hits_short_of_checkpoint"] == 0
    _assert_nothing_left(engine)
    engine.close()


def test_a_second_engine_resumes_from_the_disk_tier_of_its_tenant(model, tmp_path):
    loaded, _ = model
    want = _plain(loaded)
    first = _engine(loaded, kv_tiers=[f"disk:{tmp_path}:64MiB"])
    assert _run(first, PROMPTS[0], salt="tenant") == (want[0], 0)
    first.close()
    second = _engine(loaded, kv_tiers=[f"disk:{tmp_path}:64MiB"])
    assert _run(second, BASE[:80], salt="another") == (want[4], 0)  # another tenant's namespace: no KV, no state
    second.kv.reset_prefix_cache()
    assert _run(second, BASE[:80], salt="tenant") == (want[4], 64)  # extends the first prompt: its checkpoint at 64
    s = second.stats()
    assert s["state_checkpoints_from_tiers"] == 1 and s["tier_hit_tokens"] == 64
    _assert_nothing_left(second)
    second.close()


def test_a_checkpoint_missing_from_the_tier_resumes_from_a_shallower_one(model, tmp_path):
    """The disk holds KV for 64 tokens and checkpoints at 16..64; the files of 48 and 64 are removed: the second
    engine loads KV and the checkpoint up to 32, counts the hit as short of a checkpoint, and stays exact."""
    loaded, _ = model
    want = _plain(loaded)
    first = _engine(loaded, kv_tiers=[f"disk:{tmp_path}:64MiB"])
    _run(first, PROMPTS[0])
    first.tiers.flush()  # the disk writes are queued on the tier worker: wait for them before removing files
    states = first.kv.connector.states
    for n in (48, 64):
        os.remove(tmp_path / (states.key(BASE[:n], None).name + SUFFIX))
    first.close()
    second = _engine(loaded, kv_tiers=[f"disk:{tmp_path}:64MiB"])
    assert _run(second, BASE[:80]) == (want[4], 32)
    s = second.stats()
    assert s["prefix_hits_short_of_checkpoint"] == 1 and s["prefix_tokens_short_of_checkpoint"] == 32
    assert s["state_checkpoints_from_tiers"] == 1
    _assert_nothing_left(second)
    second.close()


def test_a_second_process_resumes_from_redis(model, redis_url):
    """Another process computes the prompt through Redis; this one's fresh engine resumes from its KV and state."""
    loaded, model_dir = model
    want = _plain(loaded)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", SECOND_PROCESS, model_dir, redis_url, json.dumps(PROMPTS[0])],
                          capture_output=True, text=True, check=True, env=env, timeout=300)
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"tokens": want[0], "cached": 0}
    engine = _engine(loaded, kv_tiers=[redis_url])
    assert _run(engine, BASE[:80]) == (want[4], 64)
    s = engine.stats()
    assert s["state_checkpoints_from_tiers"] == 1 and s["tier_redis_loaded_blocks"] == 4 + 1  # 4 blocks, 1 state
    _assert_nothing_left(engine)
    engine.close()


def test_close_writes_the_checkpoints_to_a_write_back_disk_tier(model, tmp_path):
    """A write-back disk tier gets nothing while the engine runs; close writes the cached blocks and the state
    checkpoints held in memory, and a second engine resumes from them."""
    loaded, _ = model
    want = _plain(loaded)
    tier = [f"disk:{tmp_path}:64MiB"]
    first = _engine(loaded, kv_tiers=tier, kv_tier_write_through=False)
    _run(first, PROMPTS[0])
    assert first.stats()["state_checkpoints_to_tiers"] == 0
    first.close()
    assert first.stats()["tier_close_queued_blocks"] >= 4 + 4  # KV blocks and checkpoints at 16, 32, 48, 64
    second = _engine(loaded, kv_tiers=tier, kv_tier_write_through=False)
    assert _run(second, BASE[:80]) == (want[4], 64)
    assert second.stats()["state_checkpoints_from_tiers"] == 1
    second.close()
