"""The compiled small_linear and oneDNN's linear on packed weights against torch's F.linear (the BLAS) on SmolLM2's
decoder shapes, weights of 30 layers so they stream from memory as in a decode step:
`python -m kvforge.ops.bench_matmul [--rows 1 2 4 8 16 32 128 1024]`. Prints, per row count and shape, each
path's speedup over F.linear (CPU time of this thread, medians); small_linear only up to 32 rows."""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from kvforge.ops.build import load_compiled
from kvforge.ops.packed_weights import packed, packed_linear

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
    small, onednn = {}, {}
    for name, (n, k) in SHAPES.items():
        weights = [torch.randn(n, k) for _ in range(1 if name == "lm_head" else layers)]
        packed_weights = [packed(w) for w in weights]
        for m in rows:
            x = torch.randn(m, k)
            blas = cpu_time(F.linear, x, weights, repeats)
            if m <= 32:
                small.setdefault(f"rows_{m}", {})[name] = blas / cpu_time(op, x, weights, repeats)
            if packed_weights[0] is not None:
                onednn.setdefault(f"rows_{m}", {})[name] = blas / cpu_time(packed_linear, x, packed_weights, repeats)
    return {"threads": torch.get_num_threads(), "small_linear_speedup_vs_blas": small,
            "onednn_packed_speedup_vs_blas": onednn}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 128, 1024])
    print(json.dumps(bench(p.parse_args().rows), indent=2))


if __name__ == "__main__":
    main()
