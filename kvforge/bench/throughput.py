"""Throughput: one seeded workload through kvforge (continuous batching) and transformers
(static batches, left padding), same model, in one invocation. transformers computes in fp32 from the file's
values (a GGUF dequantized at load); kvforge holds the weights as its `weights` mode asks (default auto: a GGUF's
block tensors as stored, computed in place).

transformers runs twice: in a fresh process as users run it (`hf`, the `speedup` baseline) and in
this process after the engine has tuned malloc (`hf_same_allocator`, `speedup_same_allocator`),
which isolates what the engine's design buys from what the allocator setting buys.
"""
from __future__ import annotations

import torch

from kvforge.bench.flops import engine_bytes, engine_flops, measure_matmul_peak, measure_read_bandwidth
from kvforge.bench.hf_baseline import load_hf_model, run_hf, run_hf_fresh_process
from kvforge.bench.timing import Clock, Span
from kvforge.bench.workload import Request, random_workload
from kvforge.progress import Progress
from kvforge.sampling_params import SamplingParams


def run_kvforge(engine, workload: list[Request], show_progress: bool = True, peak_flops: Span | None = None,
                bandwidth: Span | None = None) -> dict:
    """Runs the workload. With ceilings, `roofline_seconds` sums, step by step, the larger of the step's FLOPs
    at the matmul peak and its bytes at the read bandwidth (the time the roofline model allows), once with the
    ceilings per wall second and once (`roofline_cpu_seconds`) per second of this thread's CPU time."""
    progress = Progress("kvforge", sum(r.max_tokens for r in workload), show_progress)
    for r in workload:
        engine.add_request(r.prompt_ids, SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True))
    flops0, clock, outputs = engine_flops(engine), Clock(), 0
    flops, moved, roofline, roofline_cpu, memory_bound = flops0, engine_bytes(engine), 0.0, 0.0, 0
    while engine.has_unfinished_requests():
        got = len(engine.step())
        outputs += got
        progress.update(got)
        if peak_flops is None:
            continue
        step_flops, step_bytes = engine_flops(engine) - flops, engine_bytes(engine) - moved
        flops, moved = flops + step_flops, moved + step_bytes
        roofline += max(step_flops / peak_flops.wall, step_bytes / bandwidth.wall)
        roofline_cpu += max(step_flops / peak_flops.cpu, step_bytes / bandwidth.cpu)
        memory_bound += step_bytes / bandwidth.wall > step_flops / peak_flops.wall
    spent = clock.split()
    progress.close()
    return {"output_tokens": outputs, "seconds": spent.wall, "cpu_seconds": spent.cpu,
            "output_tok_s": outputs / spent.wall, "flops": engine_flops(engine) - flops0,
            "roofline_seconds": roofline, "roofline_cpu_seconds": roofline_cpu, "memory_bound_steps": memory_bound}


def throughput_bench(engine, model_path: str, num_requests: int = 64, prompt_len=(32, 512), output_len=(16, 256),
                     hf_batch_size: int | None = None, seed: int = 0, skip_hf: bool = False,
                     show_progress: bool = True, same_allocator: bool = True) -> dict:
    peak, bandwidth = measure_matmul_peak(engine.device), measure_read_bandwidth(engine.device)
    workload = random_workload(num_requests, prompt_len, output_len, engine.model_config.vocab_size, seed)
    ours = run_kvforge(engine, workload, show_progress, peak, bandwidth)
    ours["compute_fraction"] = ours["flops"] / ours["seconds"] / peak.wall
    ours["roofline_fraction"] = ours["roofline_seconds"] / ours["seconds"]
    ours["roofline_fraction_cpu"] = ours["roofline_cpu_seconds"] / ours["cpu_seconds"]
    result = {
        "workload": {"num_requests": num_requests, "prompt_len": list(prompt_len), "output_len": list(output_len),
                     "seed": seed, "prompt_tokens": sum(len(r.prompt_ids) for r in workload),
                     "output_tokens": sum(r.max_tokens for r in workload)},
        "matmul_peak_gflops": peak.wall / 1e9,
        "read_bandwidth_gbs": bandwidth.wall / 1e9,
        "matmul_peak_gflops_per_cpu_second": peak.cpu / 1e9,
        "read_bandwidth_gbs_per_cpu_second": bandwidth.cpu / 1e9,
        "threads": torch.get_num_threads(),
        "weights": {"kvforge": engine.weights_mode, "kvforge_bytes": engine.weight_bytes,
                    "hf": "fp32 (transformers dequantizes a GGUF's tensors at load)"},
        "kvforge": ours,
        "roofline_fraction": ours["roofline_fraction"],
        "roofline_fraction_cpu": ours["roofline_fraction_cpu"],
        "compute_fraction": ours["compute_fraction"],
    }
    if not skip_hf:
        batch = hf_batch_size or engine.config.max_num_seqs
        hf = run_hf_fresh_process(model_path, workload, batch, _pad_id(engine), torch.get_num_threads(), show_progress)
        result["hf"] = hf
        result["speedup"] = ours["output_tok_s"] / hf["output_tok_s"]
        if same_allocator:
            same = run_hf(load_hf_model(model_path), workload, batch, _pad_id(engine), show_progress)
            result["hf_same_allocator"] = same
            result["speedup_same_allocator"] = ours["output_tok_s"] / same["output_tok_s"]
    return result


def _pad_id(engine) -> int:
    eos = engine.model_config.eos_token_ids
    return eos[0] if eos else 0
