"""Memory: the same seeded workload under one KV budget with the paged and the contiguous layouts."""
from __future__ import annotations

import time

from kvforge.bench.workload import random_workload
from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.progress import Progress
from kvforge.sampling_params import SamplingParams


def run_layout(loaded, layout: str, workload, budget: int, max_model_len: int, max_num_seqs: int,
               show_progress: bool = True, label: str | None = None, **options) -> dict:
    """Run the workload to the end on one engine (EngineConfig `options` beside the layout and budget)."""
    engine = LLMEngine(EngineConfig(kv_cache_memory=budget, kv_layout=layout, max_model_len=max_model_len,
                                    max_num_seqs=max_num_seqs, enable_prefix_caching=False, **options), loaded)
    for r in workload:
        engine.add_request(r.prompt_ids, SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True))
    progress = Progress(f"{label or layout:>10}", sum(r.max_tokens for r in workload), show_progress)
    kv, bs = engine.kv, engine.kv.block_size
    live_sum = reserved_sum = 0
    peak_seqs = peak_decoding = steps = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        progress.update(len(engine.step()))
        running = engine.scheduler.running
        live_sum += sum(s.num_computed_tokens for s in running)
        reserved_sum += kv.allocator.num_used * bs
        peak_seqs = max(peak_seqs, len(running))
        peak_decoding = max(peak_decoding, sum(s.num_computed_tokens >= len(s.prompt_token_ids) for s in running))
        steps += 1
    progress.close()
    return {
        "utilization": live_sum / reserved_sum if reserved_sum else 0.0,
        "peak_concurrent_seqs": peak_seqs,  # running, including one admitted mid-prefill and preempted later
        "peak_decoding_seqs": peak_decoding,  # past their prompt at once: each holds its whole prompt's KV
        "seconds": time.perf_counter() - start,
        "steps": steps,
        "preemptions": engine.scheduler.num_preemptions,
        "num_blocks": kv.num_blocks,
        "budget_bytes": kv.num_blocks * kv.block_bytes,
        "blocks_used_peak": kv.peak_blocks_used,
    }


def memory_bench(loaded, num_requests: int = 64, prompt_len=(32, 512), output_len=(16, 256), budget: int | None = None,
                 max_model_len: int = 2048, max_num_seqs: int = 64, seed: int = 0, show_progress: bool = True,
                 hybrid: dict | None = None) -> dict:
    """Utilisation is bytes holding live tokens / bytes reserved, averaged over every step. Models with
    sliding-window layers also get the `hybrid` comparison (KV groups vs every layer kept full; `hybrid`
    holds hybrid_bench's keyword arguments)."""
    from kvforge.kv.formats import get_format
    from kvforge.kv.memory import bytes_per_token

    spec = loaded.config.kv_cache_spec()
    if budget is None:  # room for four contiguous sequences
        budget = int(4 * max_model_len * bytes_per_token(spec, get_format("fp32"), 16))
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
        from kvforge.bench.hybrid import hybrid_bench

        result["hybrid"] = hybrid_bench(loaded, seed=seed, show_progress=show_progress, **(hybrid or {}))
    return result
