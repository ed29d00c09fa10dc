"""Tier I/O never stalls the engine: with Redis paused (SIGSTOP) a new request's lookup hangs on the load worker
while running streams keep decoding; a tier that keeps failing is skipped for a back-off, then probed and used again;
a store worker that falls behind drops new stores instead of growing without bound."""
from __future__ import annotations

import os
import signal

from tier_helpers import GREEDY, GatedHost, ask_each, docs, engine

from kvforge.engine.sequence import SequenceStatus
from kvforge.kv.tiers.breaker import CircuitBreaker
from kvforge.kv.tiers.chain import TierChain
from kvforge.kv.tiers.keys import BlockKey
from kvforge.kv.tiers.redis_tier import RedisTier
from kvforge.sampling_params import SamplingParams

DESC = "fp32 {} block_size=8"


def keys(n: int, start: int = 0) -> list[BlockKey]:
    return [BlockKey(0, i.to_bytes(16, "little")) for i in range(start, start + n)]


def test_running_stream_decodes_while_a_lookup_hangs_on_paused_redis(tiny_loaded, private_redis):
    reference = ask_each(engine(tiny_loaded, blocks=24), docs()[:3])
    e = engine(tiny_loaded, blocks=24, tiers=[private_redis.url])
    made = e.tiers.tiers[0]
    e.tiers.tiers[0] = RedisTier(private_redis.url, made.description, timeout_s=5)  # hangs until SIGCONT
    made.close()
    now = [0.0]
    e.tiers.breakers[0].clock = lambda: now[0]
    stream = e.add_request(docs()[1][:5], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    e.step()
    os.kill(private_redis.process.pid, signal.SIGSTOP)
    try:
        waiting = e.add_request(docs()[0], GREEDY)
        e.step()
        lookup = e.kv.requests[waiting].load.future
        before = len(e.requests[stream].output_token_ids)
        for _ in range(10):  # every one of these steps runs while the lookup is blocked on Redis
            e.step()
            assert e.requests[waiting].status is SequenceStatus.LOADING and not lookup.done()
        assert len(e.requests[stream].output_token_ids) == before + 10
        now[0] = 1.0  # the lookup has hung past slow_call_s: a new request does not queue behind it
        late = e.add_request(docs()[2], GREEDY)
        e.step()
        assert e.requests[late].status is SequenceStatus.RUNNING and not lookup.done()
    finally:
        os.kill(private_redis.process.pid, signal.SIGCONT)
    done = {}
    while e.has_unfinished_requests():
        done.update({o.request_id: o for o in e.step() if o.finished})
    assert done[waiting].token_ids == reference[0].token_ids and done[waiting].finish_reason == "length"
    assert done[late].token_ids == reference[2].token_ids and len(done[stream].token_ids) == 40
    assert e.stats()["tier_redis_skipped_blocks"] == 4  # the late request's blocks, not asked of Redis
    e.kv.allocator.check()
    e.close()


def test_breaker_opens_after_repeated_failures_and_closes_after_recovery(private_redis):
    now = [0.0]
    breaker = CircuitBreaker(failures_to_open=3, backoff_s=10, max_backoff_s=40, slow_call_s=1, clock=lambda: now[0])
    chain = TierChain([RedisTier(private_redis.url, DESC, timeout_s=0.2)], 8, breakers=[breaker])
    chain.store(list(zip(keys(2), [b"a" * 32, b"b" * 32])))
    chain.flush()
    os.kill(private_redis.process.pid, signal.SIGSTOP)
    try:
        for _ in range(3):  # each times out
            assert chain.lookup(keys(2)) == [None, None]
        s = chain.stats_dict()
        assert s["tier_redis_failed_loads"] == 6 and s["tier_redis_circuit_open"] == 1
        assert s["tier_redis_circuit_trips"] == 1 and not chain.lookup_may_hang()
        assert chain.lookup(keys(2)) == [None, None]  # not called: skipped, not failed
        assert chain.store([(keys(1, 5)[0], b"c" * 32)])
        chain.flush()
        s = chain.stats_dict()
        assert s["tier_redis_skipped_blocks"] == 3 and s["tier_redis_failed_loads"] == 6
        now[0] = 10.0
        assert chain.lookup_may_hang()
        assert chain.lookup(keys(2)) == [None, None]  # the probe fails too: open again, for twice as long
        assert chain.stats_dict()["tier_redis_circuit_trips"] == 2 and breaker.open_until == 30.0
    finally:
        os.kill(private_redis.process.pid, signal.SIGCONT)
    now[0] = 30.0
    assert chain.lookup(keys(2)) == [0, 0]  # the probe succeeds: closed
    s = chain.stats_dict()
    assert s["tier_redis_circuit_open"] == 0 and chain.lookup_may_hang()
    assert chain.load(keys(2), [0, 0]) == [b"a" * 32, b"b" * 32]
    chain.close()


def test_engine_skips_an_open_tier_without_waiting(tiny_loaded, private_redis):
    """With the breaker open, admission looks up only the tiers that answer from memory: no loading state."""
    reference = ask_each(engine(tiny_loaded), docs()[:2])
    e = engine(tiny_loaded, tiers=["host:4KiB", private_redis.url])
    private_redis.stop()
    for _ in range(3):
        e.tiers.breakers[1].failed()
    assert not e.tiers.lookup_may_hang()
    rid = e.add_request(docs()[0], GREEDY)
    e.step()
    assert e.requests[rid].status is SequenceStatus.RUNNING
    while e.has_unfinished_requests():
        e.step()
    assert [o.token_ids for o in ask_each(e, docs()[1:2])] == [reference[1].token_ids]
    assert e.stats()["tier_redis_skipped_blocks"] > 0 and e.stats()["tier_redis_circuit_open"] == 1
    e.close()


def test_a_stalled_store_worker_drops_new_stores_instead_of_queueing_them():
    tier = GatedHost()
    chain = TierChain([tier], 8, max_queued_bytes=1000)
    assert chain.store(list(zip(keys(6), [bytes(100)] * 6)))
    assert tier.entered.wait(30)  # the worker is stuck in this store
    assert chain.store(list(zip(keys(3, 10), [bytes(100)] * 3)))
    assert not chain.store(list(zip(keys(2, 20), [bytes(100)] * 2)))  # 900 queued + 200 > 1000
    assert chain.queued_bytes == 900 and chain.stats_dict()["tier_host_dropped_stores"] == 2
    assert chain.lookup(keys(2, 20)) == [None, None]  # a dropped store is never visible
    tier.gate.set()
    chain.flush()
    assert chain.queued_bytes == 0 and len(tier) == 9
    chain.close()
