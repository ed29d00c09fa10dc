"""Memory: the same seeded workload under one KV budget with the paged and the contiguous layouts."""
from __future__ import annotations

from kvforge.bench.hybrid import hybrid_bench
from kvforge.bench.layout_run import run_layout
from kvforge.bench.workload import random_workload


def memory_bench(loaded, num_requests: int = 64, prompt_len=(32, 512), output_len=(16, 256), budget: int | None = None,
                 max_model_len: int = 2048, max_num_seqs: int = 64, seed: int = 0, show_progress: bool = True,
                 hybrid: dict | None = None) -> dict:
    """Utilisation is bytes holding live tokens / bytes reserved, averaged over every step. Models with
    sliding-window layers also get the `hybrid` comparison (KV groups vs every layer kept full; `hybrid`
    holds hybrid_bench's keyword arguments)."""
    from kvforge.kv.formats import get_format
    from kvforge.kv.groups import state_bytes_per_sequence
    from kvforge.kv.memory import bytes_per_token

    spec = loaded.config.kv_cache_spec()
    if budget is None:  # room for four contiguous sequences (and a recurrent model's state slots)
        budget = int(4 * max_model_len * bytes_per_token(spec, get_format("fp32"), 16))
        budget += max_num_seqs * state_bytes_per_sequence(loaded.config.state_groups)
    workload = random_workload(num_requests, prompt_len, output_len, loaded.config.vocab_size, seed)
    paged = run_layout(loaded, "paged", workload, budget, max_model_len, max_num_seqs, show_progress)
    contiguous = run_layout(loaded, "contiguous", workload, budget, max_model_len, max_num_seqs, show_progress)
    result = {
        "budget_bytes": budget,
        "max_model_len": max_model_len,
        "paged": paged,
        "contiguous": contiguous,
        "concurrency_ratio": paged["peak_concurrent_seqs"] / max(1, contiguous["peak_concurrent_seqs"]),
        "speedup": contiguous["seconds"] / paged["seconds"],
    }
    if any(w is not None for w in loaded.config.layer_windows()):
        result["hybrid"] = hybrid_bench(loaded, seed=seed, show_progress=show_progress, **(hybrid or {}))
    return result
