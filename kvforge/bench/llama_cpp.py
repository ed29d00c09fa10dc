"""kvforge and llama.cpp side by side on llama.cpp's batched-bench shapes, in one run, at one thread count.

For each batch size `pl` in `npl`: `pl` distinct random prompts of `npp` tokens are prefilled together, then
`ntg` decode steps each feed one token per sequence (greedy: each side feeds back its own argmax). Prefill
tok/s = pl * npp / prefill time, decode tok/s = pl * ntg / decode time, as llama-batched-bench reports them.
llama.cpp runs from `llama-cpp-python` (the optional extra `kvforge[llamacpp]`) on an F32 copy of the same
GGUF (`bench/gguf_f32.py`), with its default context settings (f16 KV cache, batch 2048); kvforge runs its
engine with an fp32 KV cache and every prompt of a batch size in one step.
"""
from __future__ import annotations

import random
import statistics

import torch

from kvforge.bench.bandwidth import gguf_bytes_per_token, model_bytes_per_token
from kvforge.bench.timing import Clock, Timing
from kvforge.bench.workload import random_tokens
from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.errors import ConfigError
from kvforge.kv.formats import get_format
from kvforge.kv.memory import budget_for
from kvforge.models.loader import load_model
from kvforge.models.quant_weights import holds_blocks
from kvforge.sampling_params import SamplingParams

INSTALL_HINT = ("llama-cpp-python is not installed; install the extra with `pip install 'kvforge[llamacpp]'` "
                "(it builds llama.cpp from source, several minutes) or run with --kvforge-only")


def llama_cpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def prompts_for(pl: int, npp: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed * 1000 + pl)
    return [random_tokens(rng, npp, vocab_size) for _ in range(pl)]


class KvforgeRunner:
    """kvforge's side of a round: an engine sized for the largest batch, prompts prefilled in one step."""

    def __init__(self, loaded, npp: int, ntg: int, most: int, weights: str = "fp32"):
        if weights == "auto" and not holds_blocks(loaded.model) and loaded.path.endswith(".gguf"):
            loaded = load_model(loaded.path, weights="auto")  # the file's block tensors as stored
        budget = budget_for(loaded.config.kv_cache_spec(), get_format("fp32"), 16, npp + ntg + 16, most, 1)
        self.engine = LLMEngine(EngineConfig(max_num_seqs=most, max_num_batched_tokens=max(most * npp, 512),
                                             kv_cache_memory=budget, max_model_len=npp + ntg + 16,
                                             enable_prefix_caching=False, weights=weights), loaded)

    def round(self, prompts: list[list[int]], ntg: int) -> Timing:
        engine = self.engine
        params = SamplingParams(temperature=0, max_tokens=ntg + 1, ignore_eos=True)
        pending = {engine.add_request(p, params) for p in prompts}
        clock = Clock()
        while pending:
            pending -= {o.request_id for o in engine.step()}
        prefilled = clock.split()
        steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        if steps != ntg:
            raise RuntimeError(f"kvforge decoded in {steps} steps, expected {ntg} (prefill did not finish in one step)")
        return Timing(prefilled, clock.split())

    def close(self) -> None:
        pass


def measure(runners: dict, npp: int, ntg: int, npl: list[int], rounds: int, vocab_size: int, seed: int) -> dict:
    """Each batch size runs every side once per round, sides alternating, so load drifts hit both alike;
    each figure is the median over rounds."""
    warm = [random_tokens(random.Random(-1), min(npp, 16), vocab_size)]
    for runner in runners.values():
        runner.round(warm, 2)
    samples = {side: {pl: [] for pl in npl} for side in runners}
    for r in range(rounds):
        for pl in npl:
            prompts = prompts_for(pl, npp, vocab_size, seed)
            order = list(runners) if r % 2 == 0 else list(reversed(runners))
            for side in order:
                samples[side][pl].append(runners[side].round(prompts, ntg))
    return {side: {f"b{pl}": _row(pl, npp, ntg, rows) for pl, rows in by_pl.items()}
            for side, by_pl in samples.items()}


def _row(pl: int, npp: int, ntg: int, timings: list[Timing]) -> dict:
    prefill = statistics.median(t.prefill.wall for t in timings)
    decode = statistics.median(t.decode.wall for t in timings)
    prefill_cpu = statistics.median(t.prefill.cpu for t in timings)
    decode_cpu = statistics.median(t.decode.cpu for t in timings)
    return {"prefill_s": prefill, "decode_s": decode, "prefill_tok_s": pl * npp / prefill,
            "decode_tok_s": pl * ntg / decode, "prefill_cpu_s": prefill_cpu, "decode_cpu_s": decode_cpu,
            "prefill_tok_per_cpu_s": pl * npp / prefill_cpu, "decode_tok_per_cpu_s": pl * ntg / decode_cpu,
            "rounds": len(timings)}


def _totals(rows: dict, npp: int, ntg: int) -> dict:
    pls = [int(k[1:]) for k in rows]
    return {"prefill_tok_s": sum(pls) * npp / sum(r["prefill_s"] for r in rows.values()),
            "decode_tok_s": sum(pls) * ntg / sum(r["decode_s"] for r in rows.values()),
            "prefill_tok_per_cpu_s": sum(pls) * npp / sum(r["prefill_cpu_s"] for r in rows.values())}


def _ratios(ours: dict, theirs: dict, npl: list[int], key: str) -> dict:
    ratio = {f"decode_b{pl}": ours[f"b{pl}"][f"decode_{key}"] / theirs[f"b{pl}"][f"decode_{key}"] for pl in npl}
    ratio["prefill"] = ours[f"prefill_{key}"] / theirs[f"prefill_{key}"]
    return ratio


def llama_cpp_bench(loaded, npp: int = 128, ntg: int = 64, npl: tuple[int, ...] = (1, 8, 32),
                    threads: int | None = None, seed: int = 0, kvforge_only: bool = False,
                    llama_gguf: str | None = None, rounds: int = 3, weights: str = "fp32",
                    llama_extra_bufts: bool = True) -> dict:
    """Both engines on the same shapes and weights; `ratio.*` = kvforge tok/s / llama.cpp tok/s (wall clock);
    at one thread `ratio_cpu.*` is the same per second of the computing thread's CPU time, which other
    processes on a shared machine inflate far less than wall time."""
    if npp < 1 or ntg < 1 or not npl or min(npl) < 1 or rounds < 1:
        raise ConfigError(f"--npp, --ntg, --rounds and every --npl must be >= 1 "
                          f"(got npp={npp}, ntg={ntg}, rounds={rounds}, npl={list(npl)})")
    if not kvforge_only and not llama_cpp_available():
        raise ConfigError(INSTALL_HINT)
    threads = threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    npl = list(npl)
    runners = {"kvforge": KvforgeRunner(loaded, npp, ntg, max(npl), weights)}
    path = None
    if not kvforge_only:
        from kvforge.bench.gguf_f32 import write_f32_gguf
        from kvforge.bench.llama_cpp_runner import LlamaCppRunner

        path = llama_gguf or str(write_f32_gguf(loaded.path))
        runners["llama_cpp"] = LlamaCppRunner(path, threads, llama_extra_bufts)
    try:
        rows = measure(runners, npp, ntg, npl, rounds, loaded.config.vocab_size, seed)
    finally:
        for runner in runners.values():
            runner.close()
    ours = rows["kvforge"]
    read = model_bytes_per_token(runners["kvforge"].engine.loaded.model)
    result = {"npp": npp, "ntg": ntg, "npl": npl, "threads": threads, "seed": seed, "rounds": rounds,
              "kvforge": {**ours, **_totals(ours, npp, ntg), "weights": weights, "kv_cache": "fp32",
                          "weight_bytes_per_token": read}}
    if kvforge_only:
        return result
    theirs = rows["llama_cpp"]
    result["llama_cpp"] = {**theirs, **_totals(theirs, npp, ntg), "gguf": path, "kv_cache": "f16",
                           "weight_bytes_per_token": gguf_bytes_per_token(path)}
    result["ratio"] = _ratios(result["kvforge"], result["llama_cpp"], npl, "tok_s")
    if threads == 1:
        result["ratio_cpu"] = _ratios(result["kvforge"], result["llama_cpp"], npl, "tok_per_cpu_s")
    return result
