"""The compiled attention kernels alone, per KV format: `python -m kvforge.bench.attention_kernels [--formats fp32 int8 ...]
[--context 2048] [--batch 4] [--queries 6] [--json]`.

SmolLM2's attention shape (3 KV heads, 9 query heads, head dim 64, block size 16) with one cache per layer for 30
layers, so blocks stream from memory as in a decode step, filled through each format's write path. Each round
times, per format, one `paged_decode` call per layer (one query per sequence) and one `paged_attend` call per
layer (`--queries` per sequence, a verification step's shape) and, for comparison, the same queries as one
`paged_decode` row each over its causal prefix (how verification rows ran before `paged_attend`); medians of
this thread's CPU time.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvforge.kv.formats import get_format
from kvforge.kv.spec import KVCacheSpec
from kvforge.ops import op_args
from kvforge.ops.build import load_compiled

LAYERS, BLOCK, KV_HEADS, HEADS, DIM = 30, 16, 3, 9, 64
FORMATS = ["fp32", "fp16", "bf16", "int8", "fp8_e4m3", "fp8_e5m2", "int4", "kivi2"]


def layer_caches(name: str, context: int, batch: int, table: torch.Tensor) -> list[tuple]:
    caches = []
    for _ in range(LAYERS):
        cache = get_format(name).allocate(KVCacheSpec(1, KV_HEADS, DIM, DIM), table.numel(), BLOCK,
                                          torch.device("cpu"), max_num_seqs=batch)
        for b in range(batch):
            for start in range(0, context, 512):
                pos = torch.arange(start, min(start + 512, context))
                k, v = torch.randn(len(pos), KV_HEADS, DIM), torch.randn(len(pos), KV_HEADS, DIM)
                cache.write(table[b, pos // BLOCK] * BLOCK + pos % BLOCK, k, v, pos)
        caches.append(op_args(cache.raw()))
    return caches


def cpu_ms(op, args: tuple, layers: list[tuple]) -> float:
    """CPU ms of op(*args, scale, window 0, *layer) for every layer."""
    start = time.thread_time()
    for parts in layers:
        op(*args, 0.125, 0, *parts)
    return 1e3 * (time.thread_time() - start)


def bench(formats: list[str], context: int, batch: int, queries: int, rounds: int) -> dict:
    if not load_compiled():
        raise SystemExit("no compiled kvforge ops on this machine: nothing to time")
    table = torch.arange(batch * -(-context // BLOCK)).view(batch, -1)
    caches = {name: layer_caches(name, context, batch, table) for name in formats}
    lens, starts = torch.full((batch,), context), torch.arange(batch + 1) * queries
    q1, qn = torch.randn(batch, HEADS, DIM), torch.randn(batch * queries, HEADS, DIM)
    per_query = (qn, table.repeat_interleave(queries, 0), (context - queries + 1 + torch.arange(queries)).repeat(batch))
    times: dict[str, tuple[list[float], ...]] = {name: ([], [], []) for name in formats}
    for _ in range(rounds):
        for name, layers in caches.items():
            times[name][0].append(cpu_ms(torch.ops.kvforge.paged_decode, (q1, table, lens), layers))
            times[name][1].append(cpu_ms(torch.ops.kvforge.paged_attend, (qn, starts, table, lens), layers))
            times[name][2].append(cpu_ms(torch.ops.kvforge.paged_decode, per_query, layers))
    rows = {name: {"decode_ms": statistics.median(d), "attend_ms": statistics.median(m),
                   "row_per_query_ms": statistics.median(r)} for name, (d, m, r) in times.items()}
    for row in rows.values():
        row["attend_vs_decode"] = row["attend_ms"] / row["decode_ms"]
        row["attend_speedup_vs_row_per_query"] = row["row_per_query_ms"] / row["attend_ms"]
        if "fp32" in rows:
            row["decode_slowdown_vs_fp32"] = row["decode_ms"] / rows["fp32"]["decode_ms"] - 1
    return {"context": context, "batch": batch, "queries": queries, "rounds": rounds, "layers": LAYERS,
            "threads": torch.get_num_threads(), "formats": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--formats", nargs="+", default=FORMATS)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--queries", type=int, default=6)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    result = bench(a.formats, a.context, a.batch, a.queries, a.rounds)
    if a.json:
        print(json.dumps(result, indent=2))
        return
    for name, row in result["formats"].items():
        print(f"{name:10s} decode {row['decode_ms']:6.1f} ms ({row.get('decode_slowdown_vs_fp32', 0):+.1%} vs fp32)"
              f"   {a.queries} queries per sequence {row['attend_ms']:6.1f} ms ({row['attend_vs_decode']:.2f}x decode;"
              f" one decode row per query {row['row_per_query_ms']:6.1f} ms)")


if __name__ == "__main__":
    main()
