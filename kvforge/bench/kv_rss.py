"""Whole-process memory at an equal KV capacity: each engine in its own fresh process on the same GGUF, with a cache
of exactly `tokens` tokens in the same precision (fp16 for kvforge, every layer holding all of them; llama.cpp's
n_ctx = tokens, f16 K and V, its default full-size sliding-window cache), one short prompt prefilled and decoded;
the figure is the process's peak RSS (VmHWM). kvforge's pool is written through once after the engine is built
(llama.cpp clears its cache buffer at context creation), so a full cache's pages count, not only those touched.

`python -m kvforge.bench.kv_rss --engine kvforge|llama_cpp --gguf FILE [--tokens 8192] [--threads 1]
[--weights auto]` prints one process's JSON; `equal_kv_rss` runs both and gives the ratio.
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys

from kvforge.errors import ConfigError

KV_DTYPE = "fp16"
BLOCK_SIZE = 16
ENGINES = ("kvforge", "llama_cpp")


def status_mib(field: str) -> float:
    """A /proc/self/status memory field (VmRSS, VmHWM) in MiB."""
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
    return round(kib / 1024, 1)


def exact_kv_config(model_config, tokens: int, weights: str = "auto", block_size: int = BLOCK_SIZE):
    """An EngineConfig whose fp16 pool holds exactly `tokens` tokens in every layer, for one sequence: no KV groups
    (a sliding-window layer keeps them all, as llama.cpp's full-size window cache does), no spare block."""
    from kvforge.config import EngineConfig
    from kvforge.kv.formats import get_format
    from kvforge.kv.memory import budget_for

    if tokens < 1 or tokens % block_size:
        raise ConfigError(f"tokens must be a positive multiple of the block size {block_size}, got {tokens}")
    if model_config.state_groups:
        raise ConfigError("a model with recurrent layers holds states beside its KV; give an attention-only model")
    budget = budget_for(model_config.kv_cache_spec(), get_format(KV_DTYPE), block_size, tokens, 1)
    return EngineConfig(kv_cache_memory=budget, kv_cache_dtype=KV_DTYPE, block_size=block_size, max_num_seqs=1,
                        max_model_len=tokens, kv_cache_groups=False, enable_prefix_caching=False, weights=weights)


def _prompt(vocab: int, npp: int) -> list[int]:
    rng = random.Random(0)
    return [rng.randrange(vocab) for _ in range(npp)]


def kvforge_process(gguf: str, tokens: int, threads: int, weights: str, npp: int, ntg: int) -> dict:
    import torch

    from kvforge.engine.engine import LLMEngine
    from kvforge.models.loader import load_model
    from kvforge.sampling_params import SamplingParams

    torch.set_num_threads(threads)
    out = {"engine": "kvforge", "rss_mib": {"start": status_mib("VmRSS")}}
    loaded = load_model(gguf, weights=weights)
    out["rss_mib"]["after_load"] = status_mib("VmRSS")
    engine = LLMEngine(exact_kv_config(loaded.config, tokens, weights), loaded)
    del loaded
    for layer in engine.kv.pool.slots:  # every page of the pool written once, as llama.cpp clears its cache
        for t in layer.tensors():
            t.zero_()
    out["rss_mib"]["after_engine_build"] = status_mib("VmRSS")
    engine.add_request(_prompt(engine.model_config.vocab_size, npp),
                       SamplingParams(temperature=0, max_tokens=ntg, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    split = engine.kv_budget_split()
    out.update(kv_tokens=engine.kv.allocator.num_blocks * engine.config.block_size, kv_bytes=split["kv_block_bytes_total"],
               weight_bytes=engine.weight_bytes, weights=engine.weights_mode)
    return out


def llama_cpp_process(gguf: str, tokens: int, threads: int, extra_bufts: bool, npp: int, ntg: int) -> dict:
    from kvforge.bench.llama_cpp_runner import LlamaCppRunner

    out = {"engine": "llama_cpp", "rss_mib": {"start": status_mib("VmRSS")}}
    runner = LlamaCppRunner(gguf, threads, extra_bufts)
    out["rss_mib"]["after_load"] = status_mib("VmRSS")
    runner.round([_prompt(runner.vocab, npp)], ntg, n_ctx=tokens)
    out.update(kv_tokens=tokens, kv_type="f16")
    return out


def equal_kv_rss(gguf: str, tokens: int = 8192, threads: int = 1, weights: str = "auto", extra_bufts: bool = True,
                 npp: int = 128, ntg: int = 16) -> dict:
    """Both engines' peak RSS, each in a fresh process; ratio = kvforge / llama.cpp (the goal: <= 2x)."""
    runs = {}
    for engine in ENGINES:
        cmd = [sys.executable, "-m", "kvforge.bench.kv_rss", "--engine", engine, "--gguf", gguf, "--tokens",
               str(tokens), "--threads", str(threads), "--weights", weights, "--npp", str(npp), "--ntg", str(ntg)]
        if not extra_bufts:
            cmd.append("--llama-no-extra-bufts")
        done = subprocess.run(cmd, check=False, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        runs[engine] = json.loads(done.stdout.strip().splitlines()[-1])
    ratio = runs["kvforge"]["max_rss_mib"] / runs["llama_cpp"]["max_rss_mib"]
    return {"tokens": tokens, "kv_dtype": KV_DTYPE, "threads": threads, **runs, "ratio_max_rss": ratio}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=ENGINES, required=True)
    p.add_argument("--gguf", required=True, help="the GGUF file both engines read as stored")
    p.add_argument("--tokens", type=int, default=8192, help="KV capacity in tokens (default 8192)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--weights", default="auto", help="kvforge's weights mode (default auto)")
    p.add_argument("--npp", type=int, default=128, help="prompt tokens of the one request (default 128)")
    p.add_argument("--ntg", type=int, default=16, help="tokens it generates (default 16)")
    p.add_argument("--llama-no-extra-bufts", action="store_true", help="llama.cpp without repacked weight buffers")
    a = p.parse_args()
    if a.engine == "kvforge":
        out = kvforge_process(a.gguf, a.tokens, a.threads, a.weights, a.npp, a.ntg)
    else:
        out = llama_cpp_process(a.gguf, a.tokens, a.threads, not a.llama_no_extra_bufts, a.npp, a.ntg)
    out["rss_mib"]["end"] = status_mib("VmRSS")
    out["max_rss_mib"] = status_mib("VmHWM")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
