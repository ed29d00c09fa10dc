"""One seeded workload run to the end on one engine, with the memory figures of every step (bench/memory.py,
bench/hybrid.py)."""
from __future__ import annotations

import time

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
