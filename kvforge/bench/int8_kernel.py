"""The int8 weight kernel alone against fp32 on SmolLM2's decoder shapes, weights of 30 layers so they stream from
memory as in a decode step: `python -m kvforge.bench.int8_kernel [--rows 1 2 4 8 16] [--baseline-source FILE]`.
Per row count, this thread's CPU time (median) for one call per weight of `kvforge::int8_linear`, the compiled fp32
`small_linear` and F.linear (the BLAS), and the int8 kernel's read speed (packed weights in huge pages, as the engine
holds them). `--baseline-source` compiles another
version of csrc/int8_matmul.cpp (e.g. `git show REV:kvforge/ops/csrc/int8_matmul.cpp > old.cpp`) with its op
renamed to `kvforge_baseline::int8_linear` and times it in the same rounds (on unpacked [N, K] weights, as
csrc/int8_matmul.cpp took them before the packed layout)."""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kvforge.ops.build import FLAGS, load_compiled
from kvforge.ops.int8 import in_huge_pages, pack, quantize_per_channel

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
LAYERS = 30


def load_baseline(source: Path) -> None:
    """Build `source` with its op under the kvforge_baseline namespace, next to the current kernel."""
    from torch.utils.cpp_extension import load

    build = Path(tempfile.mkdtemp(prefix="kvforge_int8_baseline_"))
    renamed = build / "baseline.cpp"
    text = source.read_text().replace("TORCH_LIBRARY_IMPL(kvforge,", "TORCH_LIBRARY_IMPL(kvforge_baseline,")
    renamed.write_text(text)
    lib = torch.library.Library("kvforge_baseline", "DEF")
    lib.define("int8_linear(Tensor x, Tensor qweight, Tensor scale, Tensor? bias) -> Tensor")
    load(name="kvforge_int8_baseline", sources=[str(renamed)], build_directory=str(build), extra_cflags=list(FLAGS),
         extra_ldflags=["-fopenmp"], is_python_module=False)
    load_baseline.lib = lib  # the schema lives as long as the process


def cpu_time(calls: list) -> float:
    start = time.thread_time()
    for call in calls:
        call()
    return time.thread_time() - start


@torch.inference_mode()
def bench(rows: list[int], repeats: int = 9, baseline: Path | None = None) -> dict:
    if not load_compiled():
        raise SystemExit("no compiled kvforge ops on this machine: nothing to compare")
    if baseline is not None:
        load_baseline(baseline)
    weights = [(name, torch.randn(n, k)) for name, (n, k) in SHAPES.items()
               for _ in range(1 if name == "lm_head" else LAYERS)]
    quantized = [quantize_per_channel(w) for _, w in weights]
    int8_bytes = sum(q.numel() for q, _ in quantized)
    packed = dict(zip((id(q) for q, _ in quantized), in_huge_pages([pack(q) for q, _ in quantized])))  # as the engine
    paths = {"int8_linear": lambda x, w, q, s: torch.ops.kvforge.int8_linear(x, packed[id(q)], s, None),
             "small_linear": lambda x, w, q, s: torch.ops.kvforge.small_linear(x, w, None),
             "blas": lambda x, w, q, s: F.linear(x, w)}
    if baseline is not None:
        paths["baseline_int8"] = lambda x, w, q, s: torch.ops.kvforge_baseline.int8_linear(x, q, s, None)
    result = {"threads": torch.get_num_threads(), "int8_mb": int8_bytes / 1e6}
    for m in rows:
        xs = {k: torch.randn(m, k) for _, (_, k) in SHAPES.items()}
        calls = {name: [functools.partial(path, xs[w.shape[1]], w, q, s) for (_, w), (q, s) in zip(weights, quantized)]
                 for name, path in paths.items()}
        times = {name: [] for name in calls}
        for _ in range(repeats):  # paths alternate within each round
            for name, path_calls in calls.items():
                times[name].append(cpu_time(path_calls))
        ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
        result[f"rows_{m}"] = {"cpu_ms": ms, "int8_gb_s": int8_bytes / ms["int8_linear"] / 1e6,
                               "speedup_vs_small_linear": ms["small_linear"] / ms["int8_linear"],
                               **({"speedup_vs_baseline": ms["baseline_int8"] / ms["int8_linear"]}
                                  if baseline is not None else {})}
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--baseline-source", type=Path)
    args = p.parse_args()
    print(json.dumps(bench(args.rows, args.repeats, args.baseline_source), indent=2))


if __name__ == "__main__":
    main()
