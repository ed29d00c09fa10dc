"""Tiers across processes and restarts: shared tiers (disk, Redis) are write-through by default, so a second engine
reuses what the first computed while both run; closing an engine (engine.close, LLM.close, `with LLM`, garbage
collection) writes what write-back tiers would lose, within a deadline; a draft model's K/V travels with the
target's."""
from __future__ import annotations

import gc
import os

import pytest
from tier_helpers import BS, GREEDY, ask_each, docs, engine

from kvforge.llm import LLM
from kvforge.sampling_params import SamplingParams

ROOMY = 64  # pool blocks: nothing is ever evicted, so write-back alone would store nothing
PER_DOC = 32 // BS


def _disk(tmp_path) -> str:
    return f"disk:{tmp_path}:16MiB"


@pytest.mark.parametrize("kind", ["disk", "redis"])
def test_shared_tier_is_write_through_by_default(tiny_loaded, tmp_path, redis_url, kind):
    tier = _disk(tmp_path) if kind == "disk" else redis_url
    salt = f"default-{kind}-{os.getpid()}"
    reference = ask_each(engine(tiny_loaded, ROOMY), docs())
    first = engine(tiny_loaded, ROOMY, tiers=[tier])
    second = engine(tiny_loaded, ROOMY, tiers=[tier])  # started before the first computed anything
    assert first.tiers.write_through == [True]
    ask_each(first, docs(), salt=salt)
    first.tiers.flush()
    assert first.kv.allocator.num_free > 0 and first.stats()["prefix_reclaimed_blocks"] == 0  # nothing left the pool
    again = ask_each(second, docs(), salt=salt)
    assert [o.token_ids for o in again] == [o.token_ids for o in reference]
    assert [o.metrics.cached_tokens for o in again] == [32] * 4
    assert second.stats()["tier_hit_tokens"] == 4 * 32
    first.close()
    second.close()


def _entries(directory) -> list[str]:
    return [f for f in os.listdir(directory) if f.endswith(".kvb")]


def test_host_tier_stays_write_back_by_default(tiny_loaded, tmp_path):
    e = engine(tiny_loaded, ROOMY, tiers=["host:1MiB", _disk(tmp_path)])
    assert e.tiers.write_through == [False, True]
    e.close()


@pytest.mark.parametrize("host", [False, True])
def test_write_back_close_keeps_the_cache_for_the_next_engine(tiny_loaded, tmp_path, host):
    """With a host tier a small pool pushes blocks there while the rest stay cached; close writes both to disk."""
    specs = ["host:1MiB"] * host + [_disk(tmp_path)]
    reference = ask_each(engine(tiny_loaded, ROOMY), docs())
    first = engine(tiny_loaded, 8 if host else ROOMY, tiers=specs, kv_tier_write_through=False)
    ask_each(first, docs())
    first.tiers.flush()
    assert not _entries(tmp_path) and first.stats().get("tier_host_stored_blocks", 1) > 0  # write-back: disk got nothing while running
    first.close()
    s = first.stats()
    assert s["tier_close_queued_blocks"] == 4 * PER_DOC and s["tier_close_unwritten_blocks"] == 0
    assert len(_entries(tmp_path)) == 4 * PER_DOC
    second = engine(tiny_loaded, ROOMY, tiers=[_disk(tmp_path)])
    again = ask_each(second, docs())
    assert [o.token_ids for o in again] == [o.token_ids for o in reference]
    assert second.stats()["tier_hit_tokens"] == 4 * 32
    second.close()


def test_close_past_its_deadline_counts_what_it_left(tiny_loaded, tmp_path):
    e = engine(tiny_loaded, ROOMY, tiers=[_disk(tmp_path)], kv_tier_write_through=False)
    ask_each(e, docs())
    e.close(timeout=0)
    s = e.stats()
    assert s["tier_close_unwritten_blocks"] == 4 * PER_DOC and s["tier_close_queued_blocks"] == 0
    assert not _entries(tmp_path)
    e.close()  # a second close does nothing
    assert e.tiers.closed


def _llm(tiny_dir: str, tmp_path) -> LLM:
    return LLM(tiny_dir, kv_tiers=[_disk(tmp_path)], kv_tier_write_through=False, kv_cache_memory="4MiB",
               block_size=BS, max_model_len=64)


def _hits(tiny_dir: str, tmp_path) -> int:
    with _llm(tiny_dir, tmp_path) as llm:
        llm.generate(docs(1), GREEDY)
        return llm.engine.stats()["tier_hit_tokens"]


def test_llm_context_manager_and_garbage_collection_keep_the_cache(tiny_dir, tmp_path):
    with _llm(tiny_dir, tmp_path) as llm:
        llm.generate(docs(1), GREEDY)
    assert llm.engine.tiers.closed and len(_entries(tmp_path)) == PER_DOC
    assert _hits(tiny_dir, tmp_path) == 32

    for f in os.listdir(tmp_path):
        os.remove(os.path.join(tmp_path, f))
    llm = _llm(tiny_dir, tmp_path)
    llm.generate(docs(1), GREEDY)
    engine_of_it = llm.engine
    del llm
    gc.collect()
    assert engine_of_it.tiers.closed and len(_entries(tmp_path)) == PER_DOC
    assert _hits(tiny_dir, tmp_path) == 32


def _spec(tiny_dir: str) -> dict:
    return {"method": "draft", "model": tiny_dir, "num_speculative_tokens": 3}


def test_draft_model_kv_travels_with_the_target(tiny_loaded, tiny_dir, tmp_path):
    """Draft = target accepts every draft; a block loaded from a tier must bring the draft's K/V too, else the
    draft reads stale rows and acceptance falls."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = [o.token_ids for o in _ask(engine(tiny_loaded, ROOMY), params)]
    first = engine(tiny_loaded, ROOMY, tiers=[_disk(tmp_path)], speculative=_spec(tiny_dir))
    assert [o.token_ids for o in _ask(first, params)] == plain
    first.close()
    second = engine(tiny_loaded, ROOMY, tiers=[_disk(tmp_path)], speculative=_spec(tiny_dir))
    assert [o.token_ids for o in _ask(second, params)] == plain
    s = second.stats()
    assert s["tier_hit_tokens"] == 4 * 32
    assert s["spec_num_draft_tokens"] > 0 and s["spec_num_accepted_tokens"] == s["spec_num_draft_tokens"]
    second.close()
    no_draft = engine(tiny_loaded, ROOMY, tiers=[_disk(tmp_path)])  # entries with draft K/V are another namespace
    _ask(no_draft, params)
    assert no_draft.stats()["tier_hit_tokens"] == 0
    no_draft.close()


def _ask(e, params) -> list:
    outs = []
    for p in docs():
        rid = e.add_request(p, params)
        while e.has_unfinished_requests():
            outs += [o for o in e.step() if o.finished and o.request_id == rid]
    return outs
