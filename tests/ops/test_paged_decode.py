"""kvforge::paged_decode and kvforge::paged_attend, compiled CPU kernels vs the torch path, on random block tables for every format.

Caches are filled through each format's own write path in random chunks, so blocks end up as codes,
in staging entries (partly filled and full), with sink entries and outliers, as in the engine.
"""
import math
import zlib

import pytest
import torch
from thread_count import threads

from kvforge.kv.formats import get_format
from kvforge.kv.spec import KVCacheSpec
from kvforge.ops import op_args, reference
from kvforge.ops.build import load_compiled

FORMATS = [("fp32", {}), ("fp16", {}), ("bf16", {}), ("int8", {}), ("fp8_e4m3", {}), ("fp8_e5m2", {}),
           ("int4", {}), ("int4", {"key_axis": "token", "group_size": 16}), ("int4", {"scale_bits": 16, "sinks": 0}),
           ("kivi2", {}), ("kivi2", {"window": 16, "group_size": 16}), ("kivi2", {"window": 0, "scale_bits": 16}),
           ("kivi2", {"outlier_frac": 0.0, "sinks": 0}),
           # many outliers per block and head, every block in codes: the in-place reads' sparse corrections
           ("kivi2", {"window": 0, "outlier_frac": 0.1}), ("int4", {"window": 0, "outlier_frac": 0.05})]
SHAPES = {"mha": (4, 4), "gqa": (2, 6), "mqa": (1, 4)}  # kv heads, query heads
BLOCK, DIM = 16, 64
LENS = [1, 17, 40, 150, 64]  # one key; rows past a block edge; whole blocks


@pytest.fixture(scope="module")
def compiled():
    if not load_compiled():
        pytest.skip("no compiled kvforge ops on this machine (no compiler, or the build failed)")


def filled_cache(name, opts, kv_heads, gen):
    """A layer holding LENS sequences written in random chunks; returns (cache, block table [B, W])."""
    spec = KVCacheSpec(1, kv_heads, DIM, DIM)
    need = [math.ceil(n / BLOCK) for n in LENS]
    cache = get_format(name, **opts).allocate(spec, sum(need) + 4, BLOCK, torch.device("cpu"), max_num_seqs=1)
    ids = torch.randperm(sum(need) + 4, generator=gen)[: sum(need)].tolist()
    table = torch.zeros(len(LENS), max(need), dtype=torch.long)
    for b, n in enumerate(LENS):
        mine, ids = ids[: need[b]], ids[need[b]:]
        table[b, : need[b]] = torch.tensor(mine)
        pos = 0
        while pos < n:
            step = min(n - pos, int(torch.randint(1, 24, (1,), generator=gen)))
            p = torch.arange(pos, pos + step)
            slots = table[b, p // BLOCK] * BLOCK + p % BLOCK
            k, v = (torch.randn(step, kv_heads, DIM, generator=gen) * 2 for _ in range(2))
            cache.write(slots, k, v, p)
            pos += step
    return cache, table


def gathered_attention(q, cache, table, lens, scale, window):
    """The decode math of attention.py over LayerKV.gather (the torch path the engine runs without the op)."""
    k, v = cache.gather(table.flatten())
    b, length = table.shape[0], table.shape[1] * BLOCK
    k, v = (x.view(b, length, x.shape[1], -1).transpose(1, 2) for x in (k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    pos = torch.arange(length)[None, :]
    valid = (pos < lens[:, None]) & ((pos >= lens[:, None] - window) if window else True)
    scores = torch.einsum("bhd,bhld->bhl", q, k) * scale
    probs = torch.softmax(scores.masked_fill(~valid[:, None], float("-inf")), -1)
    return torch.einsum("bhl,bhld->bhd", probs, v)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("name,opts", FORMATS, ids=[f"{n}{o or ''}".replace(" ", "") for n, o in FORMATS])
def test_compiled_matches_torch_path(compiled, name, opts, shape):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{name}{opts}{shape}".encode()))
    kv_heads, heads = SHAPES[shape]
    cache, table = filled_cache(name, opts, kv_heads, gen)
    q = torch.randn(len(LENS), heads, DIM, generator=gen)
    lens = torch.tensor(LENS)
    raw = cache.raw()
    assert raw is not None
    for window in (0, 20):
        want = gathered_attention(q, cache, table, lens, 0.125, window)
        got = []
        for n in (1, 2):  # one thread puts a sequence's KV heads in one task (5 sequences suffice); two split them
            with threads(n):
                got.append(torch.ops.kvforge.paged_decode(q, table, lens, 0.125, window, *op_args(raw)))
        torch.testing.assert_close(got[0], want, atol=2e-5, rtol=1e-4)
        assert torch.equal(got[0], got[1]), "a head's result depends on how tasks split the heads"
        ref = reference.paged_decode(q, table, lens, 0.125, window, *op_args(raw))
        torch.testing.assert_close(ref, want, atol=2e-5, rtol=1e-4)


QUERIES = [1, 6, 3, 20, 8]  # per sequence of LENS: one, across a block edge (12..17), two runs of MAX_RUN (16)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("name,opts", FORMATS, ids=[f"{n}{o or ''}".replace(" ", "") for n, o in FORMATS])
def test_multi_query_matches_one_decode_row_per_query(compiled, name, opts, shape):
    """paged_attend: every query of a sequence sees its causal prefix (as a decode row at its own position)."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"attend{name}{opts}{shape}".encode()))
    kv_heads, heads = SHAPES[shape]
    cache, table = filled_cache(name, opts, kv_heads, gen)
    counts = torch.tensor(QUERIES)
    starts = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    seq = torch.repeat_interleave(torch.arange(len(LENS)), counts)
    own = torch.tensor(LENS)[seq] - counts[seq] + 1 + torch.arange(len(seq)) - starts[seq]  # keys each query sees
    q = torch.randn(len(seq), heads, DIM, generator=gen)
    raw = cache.raw()
    for window in (0, 20):
        want = gathered_attention(q, cache, table[seq], own, 0.125, window)
        got = []
        for n in (1, 2):  # one thread puts a sequence's KV heads in one task (5 sequences suffice); two split them
            with threads(n):
                got.append(torch.ops.kvforge.paged_attend(q, starts, table, torch.tensor(LENS), 0.125, window,
                                                          *op_args(raw)))
        torch.testing.assert_close(got[0], want, atol=2e-5, rtol=1e-4)
        assert torch.equal(got[0], got[1]), "a head's result depends on how tasks split the heads"
        ref = reference.paged_attend(q, starts, table, torch.tensor(LENS), 0.125, window, *op_args(raw))
        torch.testing.assert_close(ref, want, atol=2e-5, rtol=1e-4)


def test_multi_query_refuses_more_queries_than_keys(compiled):
    cache, table = filled_cache("fp32", {}, 2, torch.Generator().manual_seed(1))
    starts = torch.tensor([0, 2, 4, 6, 8, 10])
    with pytest.raises(RuntimeError, match="has 2 queries but 1 keys"):
        torch.ops.kvforge.paged_attend(torch.randn(10, 4, DIM), starts, table, torch.tensor(LENS), 0.125, 0,
                                       *op_args(cache.raw()))


def test_staged_formats_exercise_every_row_source(compiled):
    """The kivi2 cache of the tests above really holds codes, staging entries, sinks and outliers."""
    cache, table = filled_cache("kivi2", {}, 2, torch.Generator().manual_seed(0))
    raw = cache.raw()
    used = table[table.ne(0).any(1)].flatten()
    staged = raw.stage[0][used] >= 0
    assert staged.any() and (~staged).any()
    assert 0 < int((raw.sink[0] >= 0).sum()) < len(LENS)  # sink entries for max_num_seqs=1: older ones went to codes
    assert raw.k.parts[4].numel() > 0  # outlier indices


def test_kernel_bench_times_every_format_and_both_ops(compiled):
    from kvforge.bench.attention_kernels import bench

    result = bench(["fp32", "kivi2"], context=40, batch=2, queries=3, rounds=1)
    assert set(result["formats"]) == {"fp32", "kivi2"}
    for row in result["formats"].values():
        assert row["decode_ms"] > 0 and row["attend_ms"] > 0 and row["row_per_query_ms"] > 0
    assert result["formats"]["fp32"]["decode_slowdown_vs_fp32"] == 0


@pytest.mark.parametrize("name,opts", [("kivi2", {}), ("kivi2", {"window": 0, "scale_bits": 16})])
def test_outliers_stored_in_any_order(compiled, name, opts):
    """The encoder stores outliers by head, row and channel, the order attention reads them in; blocks holding them
    in another order (written by an older version, say) read the same."""
    gen = torch.Generator().manual_seed(7)
    cache, table = filled_cache(name, opts, 2, gen)
    q = torch.randn(len(LENS), 6, DIM, generator=gen)
    lens = torch.tensor(LENS)
    want = torch.ops.kvforge.paged_decode(q, table, lens, 0.125, 0, *op_args(cache.raw()))
    for parts in cache.parts:
        index, value = parts[-2], parts[-1]
        assert bool((index.diff(dim=1) != 0).any()), "no outliers to reorder"
        order = torch.rand(index.shape, generator=gen).argsort(1)
        index.copy_(index.gather(1, order))
        value.copy_(value.gather(1, order))
    got = torch.ops.kvforge.paged_decode(q, table, lens, 0.125, 0, *op_args(cache.raw()))
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got, gathered_attention(q, cache, table, lens, 0.125, 0), atol=2e-5, rtol=1e-4)
