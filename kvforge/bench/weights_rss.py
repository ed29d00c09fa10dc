"""Resident memory of the weights as an engine holds them: RSS after loading a model, after building an engine
on it (every weight layout made, models/weight_store.py) and after a prefill, with a small fixed KV budget so the
pool does not dominate. `python -m kvforge.bench.weights_rss [--weights fp32|int8|auto|q8_0|q4_0] [--prompt-tokens 700]
[--kv-cache-memory 64MiB] [--model PATH]` prints JSON (MiB); run one process per setting (RSS only grows within one).
Uses only LLMEngine's public API, so the same file measures an older checkout too."""
from __future__ import annotations

import argparse
import gc
import json
import time

import torch


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return round(kib / 1024, 1)


def measure(model: str | None, weights: str, prompt_tokens: int, kv_cache_memory: str) -> dict:
    from kvforge import SamplingParams
    from kvforge.config import EngineConfig
    from kvforge.engine.engine import LLMEngine
    from kvforge.models.loader import load_model

    out = {"weights": weights, "prompt_tokens": prompt_tokens, "kv_cache_memory": kv_cache_memory,
           "rss_mib": {"start": rss_mib()}}
    clock = time.perf_counter()
    loaded = load_model(model, weights=weights)
    out["load_s"] = time.perf_counter() - clock  # the file in the page cache after its first read
    out["rss_mib"]["after_load"] = rss_mib()
    engine = LLMEngine(EngineConfig(model=model, kv_cache_memory=kv_cache_memory, weights=weights), loaded)
    del loaded  # the engine's own reference only: an int8 engine's fp32 originals may now go
    gc.collect()
    out["rss_mib"]["after_engine_build"] = rss_mib()
    vocab = engine.model_config.vocab_size
    prompt = torch.randint(0, vocab, (prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0))
    while engine.has_unfinished_requests():
        engine.step()
    gc.collect()
    out["rss_mib"]["after_prefill"] = rss_mib()
    out["engine_weight_bytes"] = getattr(engine, "weight_bytes", None)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2)")
    from kvforge.config import WEIGHT_KINDS

    p.add_argument("--weights", choices=list(WEIGHT_KINDS), default="fp32", help="weights mode (default fp32)")
    p.add_argument("--prompt-tokens", type=int, default=700, help="prefill length (default 700)")
    p.add_argument("--kv-cache-memory", default="64MiB", help="KV budget (default 64MiB)")
    a = p.parse_args()
    print(json.dumps(measure(a.model, a.weights, a.prompt_tokens, a.kv_cache_memory)))


if __name__ == "__main__":
    main()
