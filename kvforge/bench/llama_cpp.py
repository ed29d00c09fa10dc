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
import time

import torch

from kvforge.bench.workload import random_tokens
from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.errors import ConfigError
from kvforge.kv.formats import get_format
from kvforge.kv.memory import budget_for
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


def run_kvforge(loaded, npp: int, ntg: int, npl: list[int], seed: int, weights: str = "fp32") -> dict:
    most = max(npl)
    budget = budget_for(loaded.config.kv_cache_spec(), get_format("fp32"), 16, npp + ntg + 16, most, 1)
    engine = LLMEngine(EngineConfig(max_num_seqs=most, max_num_batched_tokens=max(most * npp, 512),
                                    kv_cache_memory=budget, max_model_len=npp + ntg + 16,
                                    enable_prefix_caching=False, weights=weights), loaded)
    _kvforge_round(engine, [random_tokens(random.Random(-1), min(npp, 16), loaded.config.vocab_size)], 2)  # warm
    rows = {}
    for pl in npl:
        prefill, decode = _kvforge_round(engine, prompts_for(pl, npp, loaded.config.vocab_size, seed), ntg)
        rows[f"b{pl}"] = _row(pl, npp, ntg, prefill, decode)
    return rows


def _kvforge_round(engine: LLMEngine, prompts: list[list[int]], ntg: int) -> tuple[float, float]:
    params = SamplingParams(temperature=0, max_tokens=ntg + 1, ignore_eos=True)
    pending = {engine.add_request(p, params) for p in prompts}
    start = time.perf_counter()
    while pending:
        pending -= {o.request_id for o in engine.step()}
    prefilled = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    if steps != ntg:
        raise RuntimeError(f"kvforge decoded in {steps} steps, expected {ntg} (prefill did not finish in one step)")
    return prefilled - start, time.perf_counter() - prefilled


def run_llama_cpp(gguf_path: str, npp: int, ntg: int, npl: list[int], threads: int, vocab_size: int,
                  seed: int) -> dict:
    from kvforge.bench.llama_cpp_runner import LlamaCppRunner

    runner = LlamaCppRunner(gguf_path, threads)
    try:
        runner.round([random_tokens(random.Random(-1), min(npp, 16), vocab_size)], 2)  # warm-up
        return {f"b{pl}": _row(pl, npp, ntg, *runner.round(prompts_for(pl, npp, vocab_size, seed), ntg))
                for pl in npl}
    finally:
        runner.close()


def _row(pl: int, npp: int, ntg: int, prefill_s: float, decode_s: float) -> dict:
    return {"prefill_s": prefill_s, "decode_s": decode_s, "prefill_tok_s": pl * npp / prefill_s,
            "decode_tok_s": pl * ntg / decode_s}


def _totals(rows: dict, npp: int, ntg: int) -> dict:
    pls = [int(k[1:]) for k in rows]
    return {"prefill_tok_s": sum(pls) * npp / sum(r["prefill_s"] for r in rows.values()),
            "decode_tok_s": sum(pls) * ntg / sum(r["decode_s"] for r in rows.values())}


def llama_cpp_bench(loaded, npp: int = 128, ntg: int = 64, npl: tuple[int, ...] = (1, 8, 32),
                    threads: int | None = None, seed: int = 0, kvforge_only: bool = False,
                    llama_gguf: str | None = None, weights: str = "fp32") -> dict:
    """Both engines on the same shapes and weights; `ratio.*` = kvforge tok/s / llama.cpp tok/s."""
    if npp < 1 or ntg < 1 or not npl or min(npl) < 1:
        raise ConfigError(f"--npp, --ntg and every --npl must be >= 1 (got npp={npp}, ntg={ntg}, npl={list(npl)})")
    if not kvforge_only and not llama_cpp_available():
        raise ConfigError(INSTALL_HINT)
    threads = threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    npl = list(npl)
    ours = run_kvforge(loaded, npp, ntg, npl, seed, weights)
    result = {"npp": npp, "ntg": ntg, "npl": npl, "threads": threads, "seed": seed,
              "kvforge": {**ours, **_totals(ours, npp, ntg), "weights": weights, "kv_cache": "fp32"}}
    if kvforge_only:
        return result
    from kvforge.bench.gguf_f32 import write_f32_gguf

    path = llama_gguf or str(write_f32_gguf(loaded.path))
    theirs = run_llama_cpp(path, npp, ntg, npl, threads, loaded.config.vocab_size, seed)
    result["llama_cpp"] = {**theirs, **_totals(theirs, npp, ntg), "gguf": path, "kv_cache": "f16"}
    ratio = {f"decode_b{pl}": ours[f"b{pl}"]["decode_tok_s"] / theirs[f"b{pl}"]["decode_tok_s"] for pl in npl}
    ratio["prefill"] = result["kvforge"]["prefill_tok_s"] / result["llama_cpp"]["prefill_tok_s"]
    result["ratio"] = ratio
    return result
