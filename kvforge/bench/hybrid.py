"""Hybrid attention memory: KV groups (sliding layers hold their window) vs every layer keeping its history.

One KV budget (room for `budget_seqs` sequences of `seq_len` tokens with every layer full), `num_requests`
sequences of `seq_len` tokens each (prefill in chunks of `chunk`): how many fit at once (the formula and
the engine's measured peak) and the time to complete them all, for both engines. `concurrency_ratio` compares
the peaks of sequences decoding at once (each holding its whole prompt), not of sequences running: the
scheduler admits one more sequence for its first chunks and preempts it when the others grow, which would add
one to both sides. With a budget of several sequences (and outputs long enough that the first sequence still
decodes when the last is prefilled) the ratio is bounded by memory, not by rounding.
"""
from __future__ import annotations

from kvforge.bench.layout_run import run_layout
from kvforge.bench.workload import Request, random_tokens
from kvforge.errors import ConfigError
from kvforge.kv.formats import get_format
from kvforge.kv.groups import build_groups
from kvforge.kv.memory import budget_for, sequences_that_fit


def hybrid_bench(loaded, seq_len: int = 4096, num_requests: int = 8, budget_seqs: int = 2, output_len: int = 128,
                 block_size: int = 16, kv_dtype: str = "fp32", chunk: int = 256, seed: int = 0,
                 show_progress: bool = True) -> dict:
    import random

    windows = loaded.config.layer_windows()
    if all(w is None for w in windows):
        raise ConfigError("the hybrid memory comparison needs a model with sliding-window layers "
                          "(config.json sliding_window / layer_types)")
    spec, fmt = loaded.config.kv_cache_spec(), get_format(kv_dtype)
    grouped, full = build_groups(windows), build_groups(windows, hybrid=False)
    budget = budget_for(spec, fmt, block_size, seq_len, budget_seqs, groups=full)
    rng = random.Random(seed)
    workload = [Request(random_tokens(rng, seq_len - output_len, loaded.config.vocab_size), output_len)
                for _ in range(num_requests)]
    runs = {}
    for name, groups in (("groups", True), ("full_layers", False)):
        runs[name] = run_layout(loaded, "paged", workload, budget, seq_len, num_requests, show_progress, name,
                                kv_cache_groups=groups, block_size=block_size, kv_cache_dtype=kv_dtype,
                                max_num_batched_tokens=chunk, kv_staging_share=1.0)
        runs[name].pop("utilization")  # live tokens per block row: not comparable across block shapes
        runs[name]["sequences_that_fit"] = sequences_that_fit(spec, fmt, block_size, budget, seq_len,
                                                              grouped if groups else full)
    g, f = runs["groups"], runs["full_layers"]
    return {
        "seq_len": seq_len,
        "budget_bytes": budget,
        "num_requests": num_requests,
        "layers_full": sum(w is None for w in windows),
        "layers_sliding": sum(w is not None for w in windows),
        "window": max(w for w in windows if w is not None),
        **runs,
        "concurrency_ratio": g["peak_decoding_seqs"] / max(1, f["peak_decoding_seqs"]),
        "formula_ratio": g["sequences_that_fit"] / max(1, f["sequences_that_fit"]),
        "speedup": f["seconds"] / g["seconds"],
    }
