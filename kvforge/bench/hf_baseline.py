"""The transformers baseline in a fresh process: `python -m kvforge.bench.hf_baseline SPEC.json`.

The engine tunes the process's malloc (engine/host_memory.py), which speeds up transformers too
when it runs in the same process. Running it here shows transformers as a user runs it; the
benchmark also reports it under kvforge's setting, so both ratios are on the record.
SPEC: {"model": path, "workload": [[prompt_ids, max_tokens], ...], "batch_size": n, "pad_id": id,
"threads": n, "progress": bool}; the result dict is printed as JSON on stdout.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from kvforge.bench.workload import Request


def run_hf_fresh_process(model_path: str, workload: list[Request], batch_size: int, pad_id: int, threads: int,
                         show_progress: bool) -> dict:
    spec = {"model": model_path, "workload": [[r.prompt_ids, r.max_tokens] for r in workload],
            "batch_size": batch_size, "pad_id": pad_id, "threads": threads, "progress": show_progress}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    try:
        out = subprocess.run([sys.executable, "-m", "kvforge.bench.hf_baseline", f.name], stdout=subprocess.PIPE,
                             text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    finally:
        os.unlink(f.name)
    return json.loads(out.stdout)


def main(path: str) -> None:
    import torch

    from kvforge.bench.throughput import load_hf_model, run_hf

    with open(path) as f:
        spec = json.load(f)
    torch.set_num_threads(spec["threads"])
    workload = [Request(ids, n) for ids, n in spec["workload"]]
    result = run_hf(load_hf_model(spec["model"]), workload, spec["batch_size"], spec["pad_id"], spec["progress"])
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
