"""A quantized cache gives a request the same numerics whatever ran before it or beside it (issue 30, item 2).

Staging entries (the fp16 window of int4 / kivi2 / fp8_e4m3) belong to the request whose window holds the block:
freed blocks give theirs back, and one request's new block never takes another's entry.
(a) fresh engine, (b) after unrelated traffic (lengths off the block grid, aborts, finishes mid-block), the same
batch: bit-identical tokens and logprobs (the same steps run on the same shapes). (c) batched with unrelated
requests, or with its prompts cut into chunks by the budget they leave: identical tokens, logprobs within 1e-4
(other rows change the matmul kernels' row counts, and chunks the attention sums, so fp32 rounds differently:
~1e-6 seen; a request's staging never depends on the others). After every step each running request's window
holds its entries. Prefix caching is off in these so that no request reuses another's blocks; the last tests
cover sink entries and adopted prefix blocks with it on, and compaction.
"""
import random

import pytest
import torch

from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.sampling_params import SamplingParams

FORMATS = [("int8", {}), ("fp8_e4m3", {}), ("int4", {"group_size": 16}), ("kivi2", {"group_size": 16, "window": 16})]
MEASURED = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
rng = random.Random(30)
PROMPTS = [[rng.randrange(3, 96) for _ in range(n)] for n in (21, 37, 13)]
TRAFFIC = [([rng.randrange(3, 96) for _ in range(n)], m) for n, m in ((5, 3), (19, 14), (44, 9), (8, 29), (30, 2),
                                                                       (11, 6), (26, 21), (3, 12))]


def engine(loaded, fmt, opts, **kw):
    options = {"block_size": 8, "max_model_len": 128, "max_num_seqs": 4, "max_num_batched_tokens": 512,
               "enable_prefix_caching": False, "kv_cache_memory": 1 << 22, **kw}
    e = LLMEngine(EngineConfig(kv_cache_dtype=fmt, kv_cache_options=opts, **options), loaded)
    e.runner.detokenize = str  # the tiny model has no tokenizer; logprobs name tokens by id
    return e


def drain(e, measured: list[str], abort_after: dict[str, int], arrive_after: tuple[int, list] = (0, []),
          cached: bool = False) -> list:
    """Step until done, aborting requests after their step count and adding `arrive_after[1]` (prompt, max_tokens)
    requests after `arrive_after[0]` steps; every block comes back."""
    done, steps = {}, 0
    while e.has_unfinished_requests():
        done.update({o.request_id: o for o in e.step() if o.finished})
        steps += 1
        assert_windows_staged(e)
        for rid in [rid for rid, at in abort_after.items() if at == steps]:
            e.abort(rid)
        if steps == arrive_after[0]:
            abort_after.update(traffic(e, *arrive_after[1], start=steps))
    assert not e.kv.requests
    assert e.kv.allocator.num_used == (e.kv.prefix_tree.cached_blocks if cached else 0)
    return [done[i] for i in measured]


def assert_windows_staged(e) -> None:
    """Every block of a running request's fp16 window holds a staging entry in every layer: none was taken away."""
    for state in e.kv.requests.values():
        window = getattr(state, "staged", [])
        if window and not state.parked:
            assert all(bool((layer.stage.lookup(torch.tensor(window)) >= 0).all()) for layer in e.kv.pool.slots)


def traffic(e, first: int, count: int, start: int = 0) -> dict[str, int]:
    """Unrelated requests (prompt lengths and ends off the block grid); every third one is aborted a few steps in:
    returns {request id: step to abort after}."""
    aborts = {}
    for j in range(first, first + count):
        prompt, max_tokens = TRAFFIC[j % len(TRAFFIC)]
        rid = e.add_request([(t + j) % 96 for t in prompt], SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                           ignore_eos=True))
        if j % 3 == 2:
            aborts[rid] = start + 2 + j % 4
    return aborts


def measure(e) -> list:
    return drain(e, [e.add_request(p, MEASURED) for p in PROMPTS], {})


def logprobs(out) -> list[float]:
    """The chosen token's and the top alternatives' logprobs at every step."""
    return [x for d in out.logprobs for x in [d["logprob"]] + [t["logprob"] for t in d["top"]]]


@pytest.mark.parametrize("fmt,opts", FORMATS, ids=[f for f, _ in FORMATS])
def test_same_numerics_after_unrelated_traffic(tiny_loaded, fmt, opts):
    fresh = measure(engine(tiny_loaded, fmt, opts))
    e = engine(tiny_loaded, fmt, opts)
    for first in (0, 8, 16):  # three rounds, each more requests than max_num_seqs
        drain(e, [], traffic(e, first, 8))
    after = measure(e)
    for a, b in zip(fresh, after):
        assert a.finish_reason == b.finish_reason == "length"
        assert a.token_ids == b.token_ids
        assert logprobs(a) == logprobs(b)  # bit for bit: the same batch ran on the same shapes


@pytest.mark.parametrize("fmt,opts", FORMATS, ids=[f for f, _ in FORMATS])
def test_same_numerics_batched_with_unrelated_requests(tiny_loaded, fmt, opts):
    fresh = measure(engine(tiny_loaded, fmt, opts))
    e = engine(tiny_loaded, fmt, opts)
    aborts = traffic(e, 0, 2)
    measured = [e.add_request(p, MEASURED) for p in PROMPTS]
    aborts.update(traffic(e, 2, 6))
    outs = drain(e, measured, aborts, arrive_after=(7, [8, 6]))  # more arrive while the measured ones decode
    for a, b in zip(fresh, outs):
        assert a.finish_reason == b.finish_reason == "length"
        assert a.token_ids == b.token_ids
        assert logprobs(a) == pytest.approx(logprobs(b), abs=1e-4)


@pytest.mark.parametrize("fmt,opts", FORMATS, ids=[f for f, _ in FORMATS])
def test_same_numerics_when_the_budget_cuts_prompts_into_chunks(tiny_loaded, fmt, opts):
    """A prompt cut into prefill chunks where the token budget left beside other requests ends reads as in one
    chunk: chunks end on block boundaries and the fp16 window counts from the prompt's end."""
    whole = measure(engine(tiny_loaded, fmt, opts))
    e = engine(tiny_loaded, fmt, opts, max_num_batched_tokens=13)  # prompts of 21 and 37 tokens: chunks
    aborts = traffic(e, 0, 3)
    outs = drain(e, [e.add_request(p, MEASURED) for p in PROMPTS], aborts)
    for a, b in zip(whole, outs):
        assert a.finish_reason == b.finish_reason == "length"
        assert a.token_ids == b.token_ids
        assert logprobs(a) == pytest.approx(logprobs(b), abs=1e-4)


def test_running_request_keeps_its_sink_rows_beside_cached_traffic(tiny_loaded):
    """int4 keeps a sequence's first 4 positions exact in a sink entry (2 per sequence); with prefix caching on, the
    first blocks of finished requests stay cached with theirs, and a new request's claim must take one of those,
    never the entry of a request still running."""
    opts = {"group_size": 16}
    alone = engine(tiny_loaded, "int4", opts, max_num_seqs=2, enable_prefix_caching=True)
    fresh = drain(alone, [alone.add_request(PROMPTS[1], MEASURED)], {}, cached=True)
    e = engine(tiny_loaded, "int4", opts, max_num_seqs=2, enable_prefix_caching=True)
    measured = [e.add_request(PROMPTS[1], MEASURED)]
    for j in range(12):  # one at a time beside it, each with its own first block
        e.add_request([(t + 7 * j) % 96 for t in TRAFFIC[j % 8][0]] + [j], SamplingParams(temperature=0, max_tokens=2))
    out = drain(e, measured, {}, cached=True)
    assert out[0].token_ids == fresh[0].token_ids
    assert logprobs(out[0]) == pytest.approx(logprobs(fresh[0]), abs=1e-4)


@pytest.mark.parametrize("fmt,opts", FORMATS[1:], ids=[f for f, _ in FORMATS[1:]])
def test_adopted_prefix_reads_the_same_whether_its_owner_runs_or_not(tiny_loaded, fmt, opts):
    """A cached block reads as its codes: Y adopts X's first 3 blocks (X's fp16 window when X still runs: Y gets
    copies encoded as X's flush will encode them) after X finished and traffic ran, or while X runs."""
    shared = PROMPTS[1][:24]
    x, y = shared + [5, 6, 7, 8], shared + [9, 10, 11, 12, 13]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    late = engine(tiny_loaded, fmt, opts, enable_prefix_caching=True)
    drain(late, [late.add_request(x, params)], {}, cached=True)
    drain(late, [], traffic(late, 0, 8), cached=True)
    after = drain(late, [late.add_request(y, MEASURED)], {}, cached=True)[0]
    beside = engine(tiny_loaded, fmt, opts, enable_prefix_caching=True)
    ids = [beside.add_request(x, params), beside.add_request(y, MEASURED)]
    during = drain(beside, ids, {}, cached=True)[1]
    assert after.metrics.cached_tokens == during.metrics.cached_tokens == 24
    assert after.token_ids == during.token_ids
    assert logprobs(after) == pytest.approx(logprobs(during), abs=1e-4)


def test_compacted_request_keeps_filling_a_staged_block(tiny_loaded):
    """After a KV policy compacts a sequence, the block it goes on filling holds a staging entry in every layer (else
    each decode step would decode and re-encode that block's per-channel keys)."""
    e = engine(tiny_loaded, "kivi2", {"group_size": 16, "window": 8}, kv_policy="streaming",
               kv_policy_options={"budget": 21, "sinks": 4, "slack": 4})
    rid = e.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    checked = 0
    while e.has_unfinished_requests():
        e.step()
        seq, state = e.requests.get(rid), e.kv.requests.get(rid)
        if state is not None and seq is not None:
            rows = e.kv.cache_len(seq)
            last = torch.tensor([state.block_table[(rows - 1) // 8]])
            assert all(int(layer.stage.lookup(last)[0]) >= 0 for layer in e.kv.pool.slots)
            checked += rows % 8 != 0
    assert e.stats()["kv_compactions"] > 0 and checked > 10
