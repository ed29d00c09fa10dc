"""Loads run on the tier chain's load worker: a request whose blocks are coming in waits in its own state while
others keep decoding, and runs only once every block is in."""
from __future__ import annotations

import threading

from tier_helpers import GREEDY, ask_each, docs, engine

from kvforge.engine.sequence import SequenceStatus


def test_loading_request_waits_while_others_decode(tiny_loaded):
    reference = ask_each(engine(tiny_loaded), docs())
    e = engine(tiny_loaded, tiers=["host:64MiB"])
    ask_each(e, docs())
    e.kv.reset_prefix_cache()
    e.tiers.flush()
    gate = threading.Event()
    host = e.tiers.tiers[0]
    real_get = host.get
    host.get = lambda keys: gate.wait(30) and real_get(keys)  # the host tier answers when the test says so
    loading = e.add_request(docs()[0], GREEDY)
    other = e.add_request(docs()[3][:5], GREEDY)  # shares no whole block with anything cached
    finished = {}
    for _ in range(3):
        finished.update({o.request_id: o for o in e.step() if o.finished})
    seq = e.requests[loading]
    assert seq.status is SequenceStatus.LOADING and seq.num_computed_tokens == 0 and not seq.output_token_ids
    assert other in finished and e.stats()["loading"] == 1
    gate.set()
    while e.has_unfinished_requests():
        finished.update({o.request_id: o for o in e.step() if o.finished})
    assert finished[loading].token_ids == reference[0].token_ids
    assert finished[loading].metrics.cached_tokens == 32
    e.kv.allocator.check()


def test_abort_while_loading_gives_blocks_back(tiny_loaded):
    e = engine(tiny_loaded, tiers=["host:64MiB"])
    ask_each(e, docs()[:1])
    e.kv.reset_prefix_cache()
    e.tiers.flush()
    gate = threading.Event()
    host = e.tiers.tiers[0]
    real_get = host.get
    host.get = lambda keys: gate.wait(30) and real_get(keys)
    rid = e.add_request(docs()[0], GREEDY)
    e.step()
    assert e.requests[rid].status is SequenceStatus.LOADING
    assert e.kv.allocator.num_used == 0  # pool blocks are taken when the payloads are in, not while they travel
    e.abort(rid)
    gate.set()
    e.tiers.close()
    assert e.kv.allocator.num_used == 0 and not e.has_unfinished_requests()
    e.kv.allocator.check()
