"""The transformers baseline: `generate` on static batches, in this process or in a fresh one
(`python -m kvforge.bench.hf_baseline SPEC.json`).

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
import time

import torch

from kvforge.bench.workload import Request
from kvforge.progress import Progress


def load_hf_model(path: str):
    from transformers import AutoModelForCausalLM

    if os.path.isdir(path):
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    d, name = os.path.split(path)
    return AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()


@torch.inference_mode()
def run_hf(model, workload: list[Request], batch_size: int, pad_id: int, show_progress: bool = True) -> dict:
    """transformers generate on static batches: every batch runs until its longest request is done."""
    progress = Progress("transformers", sum(r.max_tokens for r in workload), show_progress)
    start, counted = time.perf_counter(), 0
    for i in range(0, len(workload), batch_size):
        batch = workload[i: i + batch_size]
        width = max(len(r.prompt_ids) for r in batch)
        ids = torch.tensor([[pad_id] * (width - len(r.prompt_ids)) + r.prompt_ids for r in batch])
        mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in batch])
        new = max(r.max_tokens for r in batch)
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                       pad_token_id=pad_id)
        counted += sum(r.max_tokens for r in batch)
        progress.update(sum(r.max_tokens for r in batch))
    elapsed = time.perf_counter() - start
    progress.close()
    return {"output_tokens": counted, "seconds": elapsed, "output_tok_s": counted / elapsed}


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
    with open(path) as f:
        spec = json.load(f)
    torch.set_num_threads(spec["threads"])
    workload = [Request(ids, n) for ids, n in spec["workload"]]
    result = run_hf(load_hf_model(spec["model"]), workload, spec["batch_size"], spec["pad_id"], spec["progress"])
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
