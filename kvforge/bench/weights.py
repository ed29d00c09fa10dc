"""Weight kinds side by side (fp32 vs weight-only int8): decode tok/s at a few batch sizes on llama.cpp's
batched-bench shapes (`bench/llama_cpp.py`'s kvforge side), the kinds interleaved in each round, so every
round's ratio has its baseline in the same stretch of time. Medians over rounds; `ratio.decode_bN` = the second
kind's median over the first's. `cpu_ms_per_step_b1`: this thread's CPU time per decode step of one sequence
(median over rounds), which other jobs on a shared machine inflate much less than wall time.
"""
from __future__ import annotations

import statistics
import time

from kvforge.bench.llama_cpp import prompts_for, run_kvforge
from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.errors import ConfigError
from kvforge.sampling_params import SamplingParams


def decode_cpu_ms(loaded, weights: str, npp: int, steps: int, seed: int) -> float:
    """CPU ms per decode step of one sequence after an npp-token prompt (a few warm-up steps first)."""
    engine = LLMEngine(EngineConfig(kv_cache_memory=1 << 27, max_model_len=npp + steps + 8, weights=weights,
                                    enable_prefix_caching=False), loaded)
    engine.add_request(prompts_for(1, npp, loaded.config.vocab_size, seed)[0],
                       SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True))
    for _ in range(4):
        engine.step()
    start = time.process_time()
    for _ in range(steps):
        engine.step()
    return (time.process_time() - start) / steps * 1e3


def weights_bench(loaded, kinds: tuple[str, ...] = ("fp32", "int8"), npp: int = 128, ntg: int = 64,
                  npl: tuple[int, ...] = (1, 8), rounds: int = 3, seed: int = 0) -> dict:
    if len(kinds) != 2 or rounds < 1:
        raise ConfigError(f"give two weight kinds (baseline first) and rounds >= 1, got {list(kinds)} and {rounds}")
    runs: dict[str, dict[str, list[float]]] = {k: {f"b{pl}": [] for pl in npl} for k in kinds}
    cpu: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(rounds):
        for kind in kinds:
            for key, row in run_kvforge(loaded, npp, ntg, list(npl), seed + r, kind).items():
                runs[kind][key].append(row["decode_tok_s"])
            cpu[kind].append(decode_cpu_ms(loaded, kind, npp, ntg, seed + r))
    base, other = kinds
    result = {"npp": npp, "ntg": ntg, "npl": list(npl), "rounds": rounds, "kinds": list(kinds)}
    for kind in kinds:
        result[kind] = {key: {"decode_tok_s": statistics.median(v), "rounds": v} for key, v in runs[kind].items()}
        result[kind]["cpu_ms_per_step_b1"] = statistics.median(cpu[kind])
    result["ratio"] = {f"decode_{key}": result[other][key]["decode_tok_s"] / result[base][key]["decode_tok_s"]
                       for key in runs[base]}
    result["ratio_per_round"] = {f"decode_{key}": [o / b for o, b in zip(runs[other][key], runs[base][key])]
                                 for key in runs[base]}
    return result
