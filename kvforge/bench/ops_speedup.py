"""Decode speed with the compiled operator on and off, per KV format, in one run:
`python -m kvforge.bench.ops_speedup [--formats fp32 int8 int4 kivi2] [--seq-len 2048] [--batch 4] [--json]`.

Engines are filled as `kvforge bench kv-formats` fills them (random K/V through each format's write
path). Every round times each format with the operator on and then off (KVFORGE_OPS=torch), so a noisy
machine slows both sides alike; medians of wall-clock and of CPU time (this thread only, which a
shared machine's other jobs do not inflate) are reported.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from kvforge.bench.kv_formats import decode_engine
from kvforge.kv.formats import parse_format_spec
from kvforge.models.loader import load_model
from kvforge.ops.build import load_compiled


def timed(engine, steps: int, ops: bool) -> tuple[float, float]:
    os.environ["KVFORGE_OPS"] = "" if ops else "torch"
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(steps):
        engine.step()
    return time.perf_counter() - wall, time.thread_time() - cpu


def ops_bench(formats: list[str], seq_len: int, batch: int, steps: int, rounds: int, block_size: int = 16) -> dict:
    if not load_compiled():
        raise SystemExit("no compiled kvforge ops on this machine: nothing to compare")
    loaded = load_model(None)
    specs = {text: parse_format_spec(text) for text in formats}
    engines = {label: decode_engine(loaded, name, seq_len, batch, 2 * steps * rounds, block_size, opts)
               for label, (name, opts) in specs.items()}
    runs: dict[tuple[str, bool], list[tuple[float, float]]] = {(f, on): [] for f in engines for on in (True, False)}
    for _ in range(rounds):
        for label, engine in engines.items():
            for on in (True, False):
                runs[label, on].append(timed(engine, steps, on))
    os.environ.pop("KVFORGE_OPS")
    rows = {}
    for label in engines:
        row = {}
        for on, side in ((True, "ops"), (False, "torch")):
            row[f"{side}_tok_s"] = statistics.median(batch * steps / w for w, _ in runs[label, on])
            row[f"{side}_cpu_tok_s"] = statistics.median(batch * steps / c for _, c in runs[label, on])
        row["speedup_cpu"] = row["ops_cpu_tok_s"] / row["torch_cpu_tok_s"]
        rows[label] = row
    if "fp32" in rows:
        for row in rows.values():
            for side in ("ops", "torch"):
                row[f"{side}_cpu_slowdown_vs_fp32"] = 1 - row[f"{side}_cpu_tok_s"] / rows["fp32"][f"{side}_cpu_tok_s"]
    return {"seq_len": seq_len, "batch": batch, "steps": steps, "rounds": rounds,
            "threads": torch.get_num_threads(), "formats": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--formats", nargs="+", default=["fp32", "fp16", "bf16", "int8", "fp8_e4m3", "int4", "kivi2"])
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    r = ops_bench(a.formats, a.seq_len, a.batch, a.steps, a.rounds)
    if a.json:
        print(json.dumps(r, indent=2))
        return
    for label, row in r["formats"].items():
        print(f"{label:10s} ops {row['ops_cpu_tok_s']:6.1f} tok/s  torch {row['torch_cpu_tok_s']:6.1f} tok/s (CPU time)"
              f"  x{row['speedup_cpu']:.2f}")


if __name__ == "__main__":
    main()
