"""The compiled small_linear and panel_linear and oneDNN's linear on packed weights against torch's F.linear (the
BLAS) on SmolLM2's decoder shapes, weights of 30 layers so they stream from memory as in a decode step:
`python -m kvforge.bench.matmul [--rows 1 2 4 8 16 32 128 1024] [--pages 2m 4k]`. Prints, per row count and
shape, each path's speedup over F.linear (CPU time of this thread, medians; small_linear only up to 32 rows), and
at one row the bandwidth (GB/s of this thread) of small_linear next to `Tensor.sum` over the same weights, with
the weights on 2 MB pages (as the engine places them, `ops/huge_pages.py`) and on torch's default 4 KB pages."""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.ops.build import load_compiled
from kvforge.ops.huge_pages import move_to_huge_pages
from kvforge.ops.packed_weights import packed, packed_linear
from kvforge.ops.panels import pack_panels

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


def layer_weights(name: str, layers: int, pages: str) -> list[torch.Tensor]:
    n, k = SHAPES[name]
    holder = nn.Module()
    for i in range(1 if name == "lm_head" else layers):
        holder.register_buffer(f"w{i}", torch.randn(n, k))
    if pages == "2m":
        move_to_huge_pages(holder)
    return list(holder.buffers())


def bandwidth(weights: list[torch.Tensor], repeats: int) -> dict[str, float]:
    """GB/s of this thread: small_linear at one row, and a plain read (`Tensor.sum`) of the same bytes."""
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    x = torch.randn(1, weights[0].shape[1])
    summed = cpu_time(lambda _x, w, _b: w.sum(), x, weights, repeats)
    linear = cpu_time(torch.ops.kvforge.small_linear, x, weights, repeats)
    return {"sum": nbytes / summed / 1e9, "small_linear": nbytes / linear / 1e9}


@torch.inference_mode()
def bench(rows: list[int], pages: list[str], layers: int = 30, repeats: int = 15) -> dict:
    if not load_compiled():
        raise SystemExit("no compiled kvforge ops on this machine: nothing to compare")
    op = torch.ops.kvforge.small_linear
    small, panel, onednn, gbps = {}, {}, {}, {}
    for name in SHAPES:
        for kind in pages:
            weights = layer_weights(name, layers, kind)
            gbps.setdefault(f"pages_{kind}", {})[name] = bandwidth(weights, repeats)
            if kind != pages[0]:
                continue
            packed_weights = [packed(w) for w in weights]
            panel_weights = [pack_panels(w) for w in weights]
            n = weights[0].shape[0]
            for m in rows:
                x = torch.randn(m, weights[0].shape[1])
                blas = cpu_time(F.linear, x, weights, repeats)
                if m <= 32:
                    small.setdefault(f"rows_{m}", {})[name] = blas / cpu_time(op, x, weights, repeats)
                panel_op = (lambda x_, p_, b_, n_=n: torch.ops.kvforge.panel_linear(x_, p_, n_, b_))
                panel.setdefault(f"rows_{m}", {})[name] = blas / cpu_time(panel_op, x, panel_weights, repeats)
                if packed_weights[0] is not None:
                    onednn.setdefault(f"rows_{m}", {})[name] = blas / cpu_time(packed_linear, x, packed_weights,
                                                                                repeats)
    return {"threads": torch.get_num_threads(), "pages": pages[0], "small_linear_speedup_vs_blas": small,
            "panel_linear_speedup_vs_blas": panel, "onednn_packed_speedup_vs_blas": onednn, "one_row_gbps": gbps}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 128, 1024])
    p.add_argument("--pages", nargs="+", choices=["2m", "4k"], default=["2m", "4k"],
                   help="where the weights live; speedups use the first")
    a = p.parse_args()
    print(json.dumps(bench(a.rows, a.pages), indent=2))


if __name__ == "__main__":
    main()
