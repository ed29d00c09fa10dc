"""The compiled small_linear against torch's F.linear (the BLAS) on SmolLM2's decoder shapes, weights of 30 layers
so they stream from memory as in a decode step: `python -m kvforge.ops.bench_matmul [--rows 1 2 4 8 16 32]`.
Prints, per row count, the speedup (F.linear CPU time / small_linear CPU time, medians) for each shape."""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from kvforge.ops.build import load_compiled

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def cpu_time(fn, x: torch.Tensor, weights: list[torch.Tensor], repeats: int) -> float:
    """Median CPU time of fn(x, w, None) over every weight."""
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        for w in weights:
            fn(x, w, None)
        times.append(time.thread_time() - start)
    return statistics.median(times)


@torch.inference_mode()
def bench(rows: list[int], layers: int = 30, repeats: int = 15) -> dict:
    if not load_compiled():
        raise SystemExit("no compiled kvforge ops on this machine: nothing to compare")
    op = torch.ops.kvforge.small_linear
    result = {}
    for m in rows:
        row = {}
        for name, (n, k) in SHAPES.items():
            weights = [torch.randn(n, k) for _ in range(1 if name == "lm_head" else layers)]
            x = torch.randn(m, k)
            row[name] = cpu_time(F.linear, x, weights, repeats) / cpu_time(op, x, weights, repeats)
        result[f"rows_{m}"] = row
    return {"threads": torch.get_num_threads(), "speedup_vs_blas": result}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    print(json.dumps(bench(p.parse_args().rows), indent=2))


if __name__ == "__main__":
    main()
